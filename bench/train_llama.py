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
qconvert converts. Deterministic for a given --seed and step count.
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

from qconvert.models import build

BOS, EOS, VOCAB = 256, 257, 320  # 256 bytes, two specials, rounded up to a multiple of 64


def corpus() -> str:
    """Python's documentation topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def tokenizer_json() -> dict:
    """A byte-level tokenizer.json: every UTF-8 byte is one token; <s> before each text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable character; the vocab gives that character id b.
    mapping = _byte_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    vocab["<s>"], vocab["</s>"] = BOS, EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return json.loads(tok.to_str())


def _byte_to_unicode() -> dict[int, str]:
    # The GPT-2 byte-to-character table that ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, positions: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "vocab_size": VOCAB,
        "max_position_embeddings": positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": BOS, "eos_token_id": EOS,
    }


def init_params(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, kv = cfg["head_dim"], cfg["num_key_value_heads"]

    def w(out, inp, std=None):
        return (rng.standard_normal((out, inp)) * (std or inp ** -0.5)).astype(np.float32)

    p = {"model.embed_tokens.weight": w(v, h, 1.0), "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": w(v, h)}
    depth = (2 * cfg["num_hidden_layers"]) ** -0.5
    for layer in range(cfg["num_hidden_layers"]):
        q = f"model.layers.{layer}"
        p[f"{q}.input_layernorm.weight"] = np.ones(h, np.float32)
        p[f"{q}.post_attention_layernorm.weight"] = np.ones(h, np.float32)
        p[f"{q}.self_attn.q_proj.weight"] = w(h, h)
        p[f"{q}.self_attn.k_proj.weight"] = w(kv * d, h)
        p[f"{q}.self_attn.v_proj.weight"] = w(kv * d, h)
        p[f"{q}.self_attn.o_proj.weight"] = w(h, h, depth * h ** -0.5)
        p[f"{q}.mlp.gate_proj.weight"] = w(i, h)
        p[f"{q}.mlp.up_proj.weight"] = w(i, h)
        p[f"{q}.mlp.down_proj.weight"] = w(h, i, depth * i ** -0.5)
    return p


def loss_fn(model, params, ids):
    logits = model.forward(params, ids[:, :-1]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


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
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.01

    @jax.jit
    def step(params, m, v, ids, t, lr):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model, p, ids))(params)
        m = jax.tree.map(lambda a, g: b1 * a + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda a, g: b2 * a + (1 - b2) * g * g, v, grads)
        corr = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        params = jax.tree.map(lambda p, a, b: p - lr * (corr * a / (jnp.sqrt(b) + eps) + wd * p * (p.ndim == 2)),
                              params, m, v)
        return params, m, v, loss

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
