"""int4's candidate recipes on one model, the same calibration tokens and held-out text for all: the table that picks
int4's defaults (docs/ACCURACY.md).

    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    python bench/int4_defaults.py /tmp/smollm2-135m --calib /tmp/licenses.txt
    python bench/int4_defaults.py /tmp/smollm2-135m --calib /tmp/licenses.txt --recipes gptq,rtn --schemes int4 \
        --lc none                                   # qconvert's rows alone
    python bench/int4_defaults.py /tmp/smollm2-135m --calib /tmp/licenses.txt --recipes none   # llm-compressor's
    python bench/int4_defaults.py /tmp/smollm2-135m --calib /tmp/licenses.txt --schemes nvfp4a16,mxfp4a16 --lc none

Rows: every recipe of --recipes (gptq: GPTQ alone, `--no-awq`; awq: AWQ with round-to-nearest, `--no-gptq`;
awq-gptq: AWQ then GPTQ, qconvert's int4 default; rtn: round-to-nearest, `--no-gptq --no-awq`) times every scheme of --schemes (int4: symmetric; int4-asym:
zero points; w4a8-fp8: int4 weights, E4M3 activations per token) times every group of --groups, converted by `qconvert
quantize`'s own functions; a scheme whose format fixes its group (nvfp4a16, nvfp4: 16, mxfp4a16: 32) takes each recipe
once, at that group, whatever --groups says (nvfp4 calibrates its input global scales, so its rtn reads the calibration
text too); plus, for each group, llm-compressor 0.14's recipes of --lc (awq-gptq-asym: AWQModifier(duo_scaling="both")
then GPTQModifier, W4A16_ASYM; gptq-asym; gptq-sym), run by bench/lc_int4.py in --lc-venv on the same token windows,
and once, its FP4 round-to-nearest of --lc (nvfp4a16-rtn, nvfp4-rtn, mxfp4a16-rtn: QuantizationModifier with the
NVFP4A16, NVFP4 or MXFP4A16 preset, bench/lc_fp4.py; NVFP4 calibrated on the same windows). A recipe, scheme or option this
build lacks (`--awq`, `int4-asym` come from their own branches) is named and skipped; so is a group that does not
divide every quantized linear's input (llm-compressor refuses one, and qconvert's layout needs it).

Each folder is evaluated as bench/accuracy.py evaluates --gguf-model: perplexity and mean KL to the float model
(nats/token) on --windows windows of the held-out text (the last --held-out of Python's documentation topics, each
window the model's document separator and 255 tokens), the perplexity change with its standard error over windows.
Activations are rounded as the server rounds them: w4a8-fp8 to E4M3 per token (bench/accuracy.py), nvfp4 (qconvert's
folders and llm-compressor's NVFP4) to E2M1 per group of 16 with E4M3 scales over each linear's input_global_scale,
as vLLM's NVFP4 activation quantizer computes them (qconvert.schemes.nvfp4_w4a4.round_nvfp4_activations).
Rows go to --results (JSON lines, one per row, keyed by model, calibration and evaluation): a row already there is
not run again, so rows recorded earlier (llm-compressor's, say) join a later run's table. The table is printed last,
as markdown for docs/ACCURACY.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import (change_standard_error, evaluate, folder_params, held_out_text,  # noqa: E402
                      simulated_linear, window_start)
from qconvert.calibration.data import load_calibration  # noqa: E402
from qconvert.calibration.observer import open_params  # noqa: E402
from qconvert.convert import ConvertOptions, convert  # noqa: E402
from qconvert.formats.errors import QConvertError  # noqa: E402
from qconvert.models import build  # noqa: E402
from qconvert.options import CalibrationOptions  # noqa: E402

RECIPES = {"gptq": {"gptq": True, "awq": False}, "awq": {"gptq": False, "awq": True},
           "awq-gptq": {"gptq": True, "awq": True}, "rtn": {"gptq": False, "awq": False}}
LC_RECIPES = ("awq-gptq-asym", "gptq-asym", "gptq-sym")
LC_FP4 = {"nvfp4a16-rtn": "NVFP4A16", "nvfp4-rtn": "NVFP4", "mxfp4a16-rtn": "MXFP4A16"}  # bench/lc_fp4.py's presets
OUT = Path(__file__).resolve().parent / "out" / "int4_defaults"


def listed(value: str) -> list[str]:
    return [] if value in ("", "none") else [v.strip() for v in value.split(",") if v.strip()]


def missing_in_build(recipe: str, scheme: str) -> str | None:
    """Why this build cannot convert (recipe, scheme), or None."""
    from qconvert.schemes import scheme_named

    fields = {f.name for f in dataclasses.fields(ConvertOptions)}
    absent = [k for k in RECIPES[recipe] if k not in fields]
    if absent:
        return f"this build has no --{absent[0]}"
    try:
        scheme_named(scheme)
    except QConvertError:
        return f"this build has no scheme {scheme}"
    return None


def fixed_group(scheme: str) -> int | None:
    """The group an FP4 scheme's format fixes (NVFP4: 16, MXFP4: 32; no --group-size), or None."""
    from qconvert.schemes import scheme_named

    try:
        chosen = scheme_named(scheme)
    except QConvertError:
        return None
    return None if chosen.takes_group_size else getattr(chosen, "group", None)


def fixed_group_plan(args, widths: set[int]) -> list:
    """The rows of the schemes whose group the format fixes: each recipe once, at that group, --groups ignored."""
    plan = []
    for scheme in listed(args.schemes):
        group = fixed_group(scheme)
        if group is None:
            continue
        if any(w % group for w in widths):
            print(f"{scheme}: skipped, its group {group} does not divide every linear's input", flush=True)
            continue
        plan += recipe_rows(args, scheme, group, None)
    return plan


def recipe_rows(args, scheme: str, group: int, group_flag: int | None) -> list:
    """qconvert's rows of `scheme` at `group`, one per recipe this build has (the others said skipped);
    `group_flag` the --group-size given, None where the format fixes it."""
    rows = []
    for recipe in listed(args.recipes):
        why = missing_in_build(recipe, scheme)
        if why:
            print(f"{recipe} {scheme}{'' if group_flag is None else f' g{group}'}: skipped, {why}", flush=True)
            continue
        rows.append((f"qconvert {recipe} {scheme} g{group}", ("qconvert", scheme, recipe, group_flag)))
    return rows


def linear_inputs(params, config: dict) -> set[int]:
    """The input widths of the linears int4 quantizes (every 2-D weight but the embedding and the head)."""
    skip = ("embed", "lm_head", "norm")
    return {int(np.shape(params[name])[-1]) for name in params
            if name.endswith(".weight") and len(np.shape(params[name])) == 2 and not any(s in name for s in skip)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a float model folder (bench/gguf_to_hf.py)")
    parser.add_argument("--calib", default="builtin", help="qconvert's --calib: a .txt file, or builtin")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--held-out", type=float, default=0.2, help="the tail of Python's documentation held out")
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    parser.add_argument("--recipes", default="gptq,awq,awq-gptq,rtn", help=f"of {', '.join(RECIPES)}, or none")
    parser.add_argument("--schemes", default="int4,int4-asym")
    parser.add_argument("--groups", default="128,64")
    parser.add_argument("--lc", default="awq-gptq-asym", help=f"llm-compressor's rows: of {', '.join(LC_RECIPES)}, "
                        "or none")
    parser.add_argument("--lc-venv", type=Path, default=Path("/work/lc-venv"))
    parser.add_argument("--results", type=Path, default=None, help="JSON lines (default: bench/out/int4_defaults/"
                        "MODEL.jsonl)")
    parser.add_argument("--table", action="store_true", help="print the table of --results and run nothing")
    args = parser.parse_args()
    for r in listed(args.recipes):
        if r not in RECIPES:
            sys.exit(f"--recipes: unknown recipe {r!r}; choose from {', '.join(RECIPES)}")
    for r in listed(args.lc):
        if r not in LC_RECIPES and r not in LC_FP4:
            sys.exit(f"--lc: unknown recipe {r!r}; choose from {', '.join((*LC_RECIPES, *LC_FP4))}")
    results = args.results or OUT / f"{args.model.name}.jsonl"
    key = {"model": args.model.name, "calib": f"{Path(args.calib).name} {args.calib_samples}x{args.calib_seqlen}",
           "eval": f"python-docs tail {args.held_out} x {args.windows} windows"}
    done = [r for r in read_rows(results) if all(r.get(k) == v for k, v in key.items())]
    if not args.table:
        run(args, key, {r["row"] for r in done}, results)
    print_table([r for r in read_rows(results) if all(r.get(k) == v for k, v in key.items())], key)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run(args, key: dict, done: set[str], results: Path) -> None:
    from tokenizers import Tokenizer

    config = json.loads((args.model / "config.json").read_text())
    float_params = {k: np.asarray(v) for k, v in open_params(args.model).items()}
    widths = linear_inputs(float_params, config)
    plan = []  # (row name, how: ("qconvert", scheme, options) | ("lc", recipe, group))
    for group in (int(g) for g in listed(args.groups)):
        if any(w % group for w in widths):
            print(f"group {group}: skipped, it does not divide every linear's input ({sorted(widths)})", flush=True)
            continue
        for scheme in listed(args.schemes):
            if fixed_group(scheme) is not None:
                continue  # FP4: its group is the format's, planned once below
            plan += recipe_rows(args, scheme, group, group)
        plan += [(f"llm-compressor {r} g{group}", ("lc", r, None, group)) for r in listed(args.lc) if r in LC_RECIPES]
    plan += fixed_group_plan(args, widths)
    plan += [(f"llm-compressor {r} {LC_FP4[r]}", ("lc", r, None, None)) for r in listed(args.lc) if r in LC_FP4]
    plan = [p for p in plan if p[0] not in done]
    if not plan:
        return
    calibration = CalibrationOptions(calib=None if args.calib == "builtin" else args.calib,
                                     calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen)
    windows_file = OUT / f"{args.model.name}-calib.npy"
    windows_file.parent.mkdir(parents=True, exist_ok=True)
    ids = load_calibration(args.calib, args.model, config, samples=args.calib_samples, seqlen=args.calib_seqlen).input_ids
    np.save(windows_file, ids)  # the very windows qconvert's convert reads, for llm-compressor
    print(f"calibration: {ids.shape[0]} x {ids.shape[1]} tokens of {args.calib}", flush=True)

    model = build(config, list(float_params))
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    tokens = tokenizer.encode(held_out_text(args.held_out), add_special_tokens=False).ids
    start = window_start(tokenizer, config)
    n = min(args.windows, len(tokens) // 255)
    windows = np.asarray([[start] + tokens[i * 255:(i + 1) * 255] for i in range(n)], np.int32)
    base_windows: list[float] = []
    base, reference, _ = evaluate(model, float_params, windows, batch=2, per_window=base_windows)
    print(f"float perplexity {base:.4f} on {windows.size} held-out tokens", flush=True)
    for row, (kind, what, recipe, group) in plan:
        out = OUT / f"{args.model.name}-{row.replace(' ', '-')}"
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        if kind == "qconvert":
            convert(str(args.model), out, ConvertOptions(scheme=what, group_size=group, **RECIPES[recipe],
                                                         calibration=calibration if calibrates(recipe, what) else None))
        else:
            subprocess.run(lc_command(args, what, group, windows_file, out), check=True, stdout=sys.stderr)
        seconds = time.perf_counter() - started
        q, params, linear = folder_to_evaluate(out, kind)
        per_window: list[float] = []
        ppl, _, kl = evaluate(model, params, windows, **({"linear": linear} if linear else {}), reference=reference,
                              batch=2, per_window=per_window)
        if q is not None:
            q.close()
        record = {**key, "row": row, "perplexity": round(ppl, 4), "float_perplexity": round(base, 4),
                  "change_pct": round(100 * (ppl / base - 1), 2),
                  "change_se_pct": round(change_standard_error(base_windows, per_window), 2),
                  "mean_kl": float(f"{kl:.4g}"), "convert_s": round(seconds)}
        print(json.dumps(record), flush=True)
        with results.open("a") as f:
            f.write(json.dumps(record) + "\n")
        shutil.rmtree(out, ignore_errors=True)


def calibrates(recipe: str, scheme: str) -> bool:
    """Whether the conversion reads calibration text: a recipe that calibrates, or a scheme whose input scales do
    (nvfp4); round-to-nearest of a weight-only scheme reads none."""
    from qconvert.schemes import scheme_named

    return any(RECIPES[recipe].values()) or bool(getattr(scheme_named(scheme), "calibrated_inputs", False))


def lc_command(args, recipe: str, group: int | None, windows_file: Path, out: Path) -> list[str]:
    """llm-compressor's run of `recipe` in --lc-venv: bench/lc_int4.py at `group`, or bench/lc_fp4.py's preset."""
    python = [str(args.lc_venv / "bin" / "python"), "-P"]
    if recipe in LC_FP4:
        preset = LC_FP4[recipe]
        windows = ["--windows", str(windows_file)] if preset == "NVFP4" else []
        return [*python, str(Path(__file__).with_name("lc_fp4.py")), str(args.model), str(out), "--preset", preset,
                *windows]
    return [*python, str(Path(__file__).with_name("lc_int4.py")), str(args.model), str(windows_file), str(out),
            "--group", str(group), "--recipe", recipe]


def nvfp4_input_linear(scales: dict[str, float], inner):
    """`inner` with each listed linear's activations rounded to NVFP4 over its input global scale first."""
    import jax.numpy as jnp

    from qconvert.schemes.nvfp4_w4a4 import round_nvfp4_activations

    def linear(name, x, weight, bias):
        if name in scales:
            rows = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
            x = round_nvfp4_activations(rows, scales[name]).reshape(x.shape)
        return inner(name, x, weight, bias)

    return linear


def folder_to_evaluate(out: Path, kind: str):
    """(the open folder or None, its params, the linear hook or None) of a converted folder: qconvert's through
    bench/accuracy.py's simulated linear (nvfp4's activations rounded over the folder's input_global_scale), or
    llm-compressor's float folder of dequantized weights (its NVFP4 input_global_scale from
    input_global_scales.json)."""
    from qconvert.models import dense_linear

    if kind == "qconvert":
        q, params = folder_params(out)
        linear = simulated_linear(q)
        if q.scheme == "nvfp4":
            linear = nvfp4_input_linear({m: q.input_scale(m) for m in q.quantized_modules}, linear)
        return q, params, linear
    params = {k: np.asarray(v) for k, v in open_params(out).items()}
    scales_file = out / "input_global_scales.json"
    if scales_file.is_file():
        return None, params, nvfp4_input_linear(json.loads(scales_file.read_text()), dense_linear)
    return None, params, None


def print_table(rows: list[dict], key: dict) -> None:
    print(f"\n{key['model']}: calibration {key['calib']}, evaluation {key['eval']}\n")
    print("| recipe | ppl change ± s.e. | mean KL (nats) | convert s |")
    print("|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["mean_kl"]):
        print(f"| {r['row']} | {r['change_pct']:+.2f}% ± {r['change_se_pct']:.2f}% | {r['mean_kl']:.4g} | "
              f"{r['convert_s']} |")


if __name__ == "__main__":
    main()
