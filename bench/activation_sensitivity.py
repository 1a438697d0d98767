"""Where a w8a8 folder's error comes from: its activations' rounding, linear kind by linear kind.

    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    python bench/activation_sensitivity.py /tmp/smollm2-135m --windows 64
    python bench/activation_sensitivity.py /tmp/gemma3-270m --windows 24 --config w8a8-auto

Converts the model once with a configuration of bench/accuracy.py (the w8a8 default, `--alpha auto`, on the
built-in calibration text, 64 x 256 tokens asked), then evaluates that one folder several times on the held-out
windows of bench/accuracy.py (the last 20% of Python's documentation topics): with the deployment's per-token
int8 rounding of every linear's input, then with that rounding skipped for one kind of linear at a time
(q/k/v, o_proj, gate/up, down_proj), and for all of them (the folder's smoothed int8 weights alone). Each line:
perplexity change against the float model with its standard error, and mean next-token KL in nats. No
deployment computes the rows with float activations; they split the folder's error between its weights and
each kind of activation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as A  # noqa: E402

KINDS = {"none": (), "q/k/v": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate/up": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "all": ("_proj",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a float folder made by bench/gguf_to_hf.py")
    parser.add_argument("--windows", type=int, default=64, help="held-out 256-token windows")
    parser.add_argument("--config", default="w8a8-auto", help="a w8a8 configuration of bench/accuracy.py")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    src = args.model
    config = json.loads((src / "config.json").read_text())
    model = A.build(config)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokens = tokenizer.encode(A.held_out_text(0.2), add_special_tokens=False).ids
    bos = A.window_start(tokenizer, config)
    n = min(args.windows, len(tokens) // 255)
    windows = np.asarray([[bos] + tokens[i * 255:(i + 1) * 255] for i in range(n)], np.int32)
    base_windows: list[float] = []
    base, reference, _ = A.evaluate(model, {k: np.asarray(v) for k, v in A.open_params(src).items()}, windows,
                                    batch=2, per_window=base_windows)
    print(f"causal LM {src.name}: float perplexity {base:.4f} on {windows.size} held-out tokens", flush=True)
    out = A.OUT / "accuracy" / f"sensitivity-{src.name}-{args.config}"
    A.run_convert(src, out, args.config, "builtin", 64, 256)
    quantized, params = A.folder_params(out)
    rounded, unrounded = A.simulated_linear(quantized), A.simulated_linear(quantized, True)
    for kind, parts in KINDS.items():
        def linear(name, x, weight, bias, parts=parts):
            float_input = bool(parts) and any(p in name for p in parts)
            return (unrounded if float_input else rounded)(name, x, weight, bias)

        started, quantized_windows = time.perf_counter(), []
        ppl, _, kl = A.evaluate(model, params, windows, linear, reference, batch=2, per_window=quantized_windows)
        print(json.dumps({"model": src.name, "config": args.config, "float_inputs": kind,
                          "change_pct": round(100 * (ppl / base - 1), 3),
                          "change_se_pct": round(A.change_standard_error(base_windows, quantized_windows), 3),
                          "mean_kl": float(f"{kl:.4g}"), "seconds": round(time.perf_counter() - started)}),
              flush=True)
    quantized.close()
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
