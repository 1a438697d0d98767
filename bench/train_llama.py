"""Train a small byte-level Llama on offline text with JAX and save it as a float Hugging Face Llama folder.

The accuracy measurements (docs/ACCURACY.md) need a causal LM whose weights
carry what training puts there (skewed rows, activation outlier channels),
which a random checkpoint lacks. This trains one in a few minutes on a CPU:

    python bench/train_llama.py --out bench/out/llama-bytes --seconds 300

Text: Python's own documentation (`pydoc_data.topics`, ~460 KB of English,
shipped with every CPython), cut into a training part and a held-out tail
(the last 5% of the text, written to OUT/heldout.txt for evaluation).
Tokens are bytes (ids 0..255) plus <s> = 256 and </s> = 257; the folder gets a
matching tokenizer.json, so `qconvert quantize --calib FILE.txt` works on it.
The forward pass is qconvert's own Llama forward, so what was trained is what
qconvert converts. Deterministic for a given --seed and step count. The pieces
(config, initialization, tokenizer, AdamW step) are those of `qconvert
example-model --llm` (qconvert/examples/llama.py), which trains a smaller one,
for a fixed number of steps, on qconvert's built-in text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from qconvert.examples.llama import BOS, adam_step, config, init_params, tokenizer_json
from qconvert.models import build


def corpus() -> str:
    """Python's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/llama-bytes"))
    parser.add_argument("--seconds", type=float, default=300.0, help="training time budget")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    text = corpus().encode("utf-8")
    cut = int(len(text) * 0.95)
    train = np.frombuffer(text[:cut], np.uint8).astype(np.int32)
    cfg = config(args.hidden, args.layers, 4, 2, args.intermediate, 2 * args.seqlen)
    model = build(cfg)
    params = {k: jnp.asarray(v) for k, v in init_params(cfg, args.seed).items()}
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    step = adam_step(model)

    rng = np.random.default_rng(args.seed)
    started, t, losses = time.perf_counter(), 0, []
    while time.perf_counter() - started < args.seconds:
        starts = rng.integers(0, train.size - args.seqlen, args.batch)
        ids = np.stack([np.concatenate([[BOS], train[s:s + args.seqlen]]) for s in starts])
        t += 1
        # Linear warm-up over 50 steps, then constant: the run is cut by time, not steps.
        lr = args.lr * min(1.0, t / 50)
        params, m, v, loss = step(params, m, v, jnp.asarray(ids), jnp.float32(t), jnp.float32(lr))
        losses.append(float(loss))
        if t % 20 == 0:
            print(f"step {t}: loss {np.mean(losses[-20:]):.3f} nats/byte, {time.perf_counter() - started:.0f} s",
                  flush=True)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.asarray(val, np.float32) for k, val in params.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (out / "heldout.txt").write_text(text[cut:].decode("utf-8", errors="ignore"), encoding="utf-8")
    (out / "train_sample.txt").write_text(text[:200_000].decode("utf-8", errors="ignore"), encoding="utf-8")
    print(json.dumps({"out": str(out), "steps": t, "seconds": round(time.perf_counter() - started, 1),
                      "final_loss": round(float(np.mean(losses[-20:])), 4)}))


if __name__ == "__main__":
    main()
