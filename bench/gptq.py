"""What GPTQ adds to calibration: w8a8's calibration phase of a 135M-shaped Llama with and without GPTQ.

    python bench/gptq.py                  # 30 layers, 64 x 512 tokens
    python bench/gptq.py --layers 6       # fewer layers (the time per layer is what compares)
    python bench/gptq.py --quick          # 4 layers, 8 x 128 tokens

The checkpoint is random (tests/checkpoints.py make_llama_checkpoint, bfloat16)
with SmolLM-135M's shapes: hidden 576, intermediate 1536, 9 heads, 3 KV heads,
vocab 49152. Calibration draws `--calib random` ids. Each side runs in a fresh
process (compile included), one after the other: `prepare_adjustments` (forward,
statistics, alpha search, clip search) with --no-gptq, then with GPTQ
(Hessians, the column loop, each layer run again on its rounded weights). It
prints the seconds of each, their ratio, and what GPTQ adds as a multiple of
the calibration without it (the target: at most 1x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SHAPE_135M = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)


def calibrate_once(model: Path, gptq: bool, samples: int, seqlen: int) -> dict:
    """Seconds of one calibration phase in this process (with the scratch folder GPTQ spills into)."""
    from qconvert.convert import _sequential_gptq, plan_conversion
    from qconvert.options import ConvertOptions, CalibrationOptions
    from qconvert.source.resolve import open_source, resolve_source
    from qconvert.methods.recipe import prepare_adjustments
    import contextlib

    options = ConvertOptions(scheme="w8a8", gptq=gptq, calibration=CalibrationOptions(calib="random", calib_samples=samples,
                                                                         calib_seqlen=seqlen))
    source = open_source(resolve_source(str(model), None, scheme=options.scheme_object))
    plan = plan_conversion(source, scheme=options.scheme_object)
    with tempfile.TemporaryDirectory(prefix="qc-gptq-out-") as out, contextlib.ExitStack() as scratch:
        started = time.perf_counter()
        sequential = _sequential_gptq(source, plan, options, Path(out) / "out", scratch)
        adjustments = prepare_adjustments(source, options, None, None, sequential,
                                          quantized_modules=plan.quantized_modules)
        seconds = time.perf_counter() - started
    rounding = adjustments.rounding_record or {"method": "rtn"}
    return {"seconds": seconds, "method": rounding["method"], "linears": len(rounding.get("modules", {}))}


def run_side(model: Path, gptq: bool, samples: int, seqlen: int) -> dict:
    argv = [sys.executable, __file__, "--one", "on" if gptq else "off", "--model", str(model),
            "--samples", str(samples), "--seqlen", str(seqlen)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(calibrate_once(args.model, args.one == "on", args.samples, args.seqlen)))
        return
    from checkpoints import make_llama_checkpoint

    layers, samples, seqlen = (4, 8, 128) if args.quick else (args.layers, args.samples, args.seqlen)
    with tempfile.TemporaryDirectory(prefix="qc-gptq-") as tmp:
        model = make_llama_checkpoint(Path(tmp) / "model", dtype="bfloat16", layers=layers, **SHAPE_135M)
        load = os.getloadavg()[0]
        off = run_side(model, False, samples, seqlen)
        print(f"without GPTQ: {off['seconds']:.1f} s (load average before {load:.1f})", flush=True)
        load = os.getloadavg()[0]
        on = run_side(model, True, samples, seqlen)
        print(f"with GPTQ:    {on['seconds']:.1f} s, {on['linears']} linears rounded (load average before "
              f"{load:.1f})", flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores; {layers} layers, {samples} x {seqlen} "
          f"tokens, shape {SHAPE_135M}")
    ratio = on["seconds"] / off["seconds"]
    print(f"ratio with / without: {ratio:.2f}x; GPTQ adds {ratio - 1:.2f}x the calibration time")


if __name__ == "__main__":
    main()
