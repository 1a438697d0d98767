"""How much of each linear's input Hessian the calibration windows' first tokens hold, and what GPTQ does with and
without them: per linear on held-out inputs, and for the whole model (docs/ACCURACY.md, "Why int4 GPTQ lost").

    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    python -c "import glob; open('/tmp/licenses.txt', 'w').write('\\n\\n'.join(open(f, errors='ignore').read()
        for f in sorted(glob.glob('/usr/share/common-licenses/*'))))"
    python bench/gptq_window_start.py capture /tmp/smollm2-135m /tmp/calib.npz --calib /tmp/licenses.txt
    python bench/gptq_window_start.py capture /tmp/smollm2-135m /tmp/held.npz --held-out 64
    python bench/gptq_window_start.py share /tmp/calib.npz
    python bench/gptq_window_start.py per-linear /tmp/smollm2-135m /tmp/calib.npz /tmp/held.npz \\
        --variants gptq,gptq:h=rest,gptq:act=1 --only layers.28.mlp.down_proj,layers.11.self_attn.v_proj
    python bench/gptq_window_start.py whole /tmp/smollm2-135m /tmp/calib.npz --windows 32 \\
        --variants rtn,gptq,gptq:h=rest-but-qkv:act=1

`capture` runs the float model (qconvert's forward, no layer rounded) over the windows and keeps, per linear,
the float64 sums XᵀX over every token and over each window's first token alone (calibration: --samples x --seqlen
of --calib, as quantize cuts them; held out: the tail of Python's documentation, each window led by the model's
document separator, as bench/accuracy.py evaluates). A variant is `rtn` or `gptq` with `:h=all|rest|rest-but-qkv`
(every token; the window starts left out; left out but for q/k/v, what calibration does now), `:damp=F` (0.1)
and `:act=1` (act order; off unless given). `per-linear` prints each linear's held-out error
|X (W - Q)^T|^2 / |X W^T|^2 apart for the window starts and the rest; `whole` rounds every linear on its float
Hessian at once (not sequentially) and prints perplexity change, its standard error and mean KL on held-out text.
int4, symmetric, groups of --group (64).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import change_standard_error, evaluate, held_out_text, window_start  # noqa: E402
from qconvert.calibration.tokenizer import token_windows  # noqa: E402
from qconvert.calibration.observer import open_params  # noqa: E402
from qconvert.calibration.statistics import reads_attention_input  # noqa: E402
from qconvert.methods.gptq_core import gptq_codes  # noqa: E402
from qconvert.models import build  # noqa: E402
from qconvert.calibration.layers import iterate_layers  # noqa: E402
from qconvert.schemes.grids import IntegerGrid  # noqa: E402
from qconvert.formats.qarray import INT4_QMAX, INT4_QMIN  # noqa: E402
from qconvert.schemes.int4 import quantize_int4  # noqa: E402

HI = jax.lax.Precision.HIGHEST


def held_out_windows(model_dir: Path, config: dict, count: int) -> np.ndarray:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokens = tokenizer.encode(held_out_text(0.2), add_special_tokens=False).ids
    start = window_start(tokenizer, config)
    return np.asarray([[start] + tokens[i * 255:(i + 1) * 255] for i in range(min(count, len(tokens) // 255))],
                      np.int32)


def capture(args) -> None:
    from tokenizers import Tokenizer

    config = json.loads((args.model / "config.json").read_text())
    params = open_params(args.model)
    model = build(config, list(params.keys()))
    if args.held_out:
        ids = held_out_windows(args.model, config, args.held_out)
    else:
        ids = token_windows(Tokenizer.from_file(str(args.model / "tokenizer.json")), Path(args.calib), args.samples,
                            args.seqlen)

    def observe(name, x, valid):
        x = x.astype(jnp.float32)
        flat = x.reshape(-1, x.shape[-1])
        return {"hessian": jnp.einsum("ti,tj->ij", flat, flat, precision=HI), "count": jnp.int32(flat.shape[0]),
                "start": jnp.einsum("bi,bj->ij", x[:, 0], x[:, 0], precision=HI),
                "start_max": jnp.max(jnp.abs(x[:, 0]), axis=0), "rest_max": jnp.max(jnp.abs(x[:, 1:]), axis=(0, 1))}

    out = {}
    for result in iterate_layers(model, params, ids, observe=observe, batch_size=8, share_programs=False):
        for name, per_batch in result.observed.items():
            out[f"{name}|H"] = np.asarray(per_batch[0]["hessian"], np.float64)  # summed over the batches
            out[f"{name}|H0"] = sum(np.asarray(p["start"], np.float64) for p in per_batch)
            out[f"{name}|max0"] = np.max([np.asarray(p["start_max"]) for p in per_batch], axis=0)
            out[f"{name}|maxr"] = np.max([np.asarray(p["rest_max"]) for p in per_batch], axis=0)
        print(f"layer {result.index} of {ids.shape[0]} x {ids.shape[1]} tokens", flush=True)
    np.savez(args.out, **out)


def modules_of(stats) -> list[str]:
    names = {k.split("|")[0] for k in stats.files}
    return sorted(names, key=lambda m: (int(m.split(".")[2]) if m.split(".")[2].isdigit() else -1, m))


def share(args) -> None:
    stats = np.load(args.stats)
    for m in modules_of(stats):
        h, h0 = stats[f"{m}|H"], stats[f"{m}|H0"]
        d = np.diag(h)
        print(json.dumps({"module": m, "start_share": round(float(np.trace(h0) / np.trace(h)), 4),
                          "mean_over_median_diag": round(float(d.mean() / np.median(d)), 2),
                          "start_max": float(stats[f"{m}|max0"].max()), "rest_max": float(stats[f"{m}|maxr"].max()),
                          "dead_columns": int(np.sum(d == 0))}))


def rounded(w: np.ndarray, m: str, stats, variant: str, group: int) -> np.ndarray:
    """The dequantized weight a variant gives linear m."""
    q = quantize_int4(w, group, scale_dtype=np.float32)
    if variant == "rtn":
        return np.asarray(q.dequantize(np.float32))
    parts = dict(p.split("=") for p in variant.split(":")[1:])
    h = stats[f"{m}|H"]
    which = parts.get("h", "all")
    if which == "rest" or (which == "rest-but-qkv" and not reads_attention_input(m)):
        h = h - stats[f"{m}|H0"]
    steps = np.repeat(np.asarray(q.scale, np.float32), group, axis=1)
    codes = gptq_codes(jnp.asarray(w), jnp.asarray(h, jnp.float32), jnp.asarray(steps), float(parts.get("damp", 0.1)),
                       grid=IntegerGrid(INT4_QMIN, INT4_QMAX), act_order=parts.get("act", "0") == "1")
    return np.asarray(codes, np.float32) * steps


def per_linear(args) -> None:
    calib, held = np.load(args.calib_stats), np.load(args.held_stats)
    params = open_params(args.model)
    only = [s for s in args.only.split(",") if s]
    for m in modules_of(calib):
        if only and not any(m.endswith(s) for s in only):
            continue
        w = np.asarray(params[f"{m}.weight"], np.float32)
        w64 = w.astype(np.float64)
        h, h0 = held[f"{m}|H"], held[f"{m}|H0"]
        row = {"module": m, "start_share_calib": round(float(np.trace(calib[f"{m}|H0"]) / np.trace(calib[f"{m}|H"])), 4)}
        for variant in ["rtn", *args.variants.split(",")]:
            d = w64 - rounded(w, m, calib, variant, args.group)
            row[variant] = {part: float(f"{np.sum((d @ hh) * d) / np.sum((w64 @ hh) * w64):.4g}")
                            for part, hh in (("rest", h - h0), ("starts", h0))}
        print(json.dumps(row), flush=True)


def whole(args) -> None:
    config = json.loads((args.model / "config.json").read_text())
    params = {k: np.asarray(v) for k, v in open_params(args.model).items()}
    model = build(config, list(params))
    stats = np.load(args.calib_stats)
    windows = held_out_windows(args.model, config, args.windows)
    base_windows: list[float] = []
    base, reference, _ = evaluate(model, params, windows, batch=4, per_window=base_windows)
    print(f"float perplexity {base:.4f} on {windows.size} held-out tokens", flush=True)
    for variant in args.variants.split(","):
        quantized = dict(params)
        for m in modules_of(stats):
            quantized[f"{m}.weight"] = rounded(params[f"{m}.weight"].astype(np.float32), m, stats, variant, args.group)
        per_window: list[float] = []
        ppl, _, kl = evaluate(model, quantized, windows, reference=reference, batch=4, per_window=per_window)
        print(json.dumps({"variant": variant, "change_pct": round(100 * (ppl / base - 1), 2),
                          "change_se_pct": round(change_standard_error(base_windows, per_window), 2),
                          "mean_kl": float(f"{kl:.4g}")}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capture")
    c.add_argument("model", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--calib", default=None, help="a .txt file (calibration windows)")
    c.add_argument("--samples", type=int, default=128)
    c.add_argument("--seqlen", type=int, default=512)
    c.add_argument("--held-out", type=int, default=0, help="this many held-out windows instead of --calib")
    s = sub.add_parser("share")
    s.add_argument("stats", type=Path)
    p = sub.add_parser("per-linear")
    p.add_argument("model", type=Path)
    p.add_argument("calib_stats", type=Path)
    p.add_argument("held_stats", type=Path)
    p.add_argument("--variants", default="gptq,gptq:h=rest,gptq:h=rest-but-qkv:act=1")
    p.add_argument("--only", default="", help="comma-separated module name endings")
    p.add_argument("--group", type=int, default=64)
    w = sub.add_parser("whole")
    w.add_argument("model", type=Path)
    w.add_argument("calib_stats", type=Path)
    w.add_argument("--windows", type=int, default=32)
    w.add_argument("--variants", default="rtn,gptq,gptq:h=rest-but-qkv:act=1")
    w.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    if args.command == "capture" and not (args.calib or args.held_out):
        sys.exit("capture: pass --calib FILE.txt or --held-out N")
    {"capture": capture, "share": share, "per-linear": per_linear, "whole": whole}[args.command](args)


if __name__ == "__main__":
    main()
