"""Time of the w8a8 preparation (calibration, smoothing, searches) with the default flags against a fixed alpha.

    python bench/alpha_search.py                 # the trained byte Llama and a wider random Llama
    python bench/alpha_search.py --samples 16    # a quicker run

For each model, in one process: `prepare_adjustments` (everything `quantize --scheme w8a8`
does before it writes: calibration forward passes, the alpha grid per group,
the weight clip and static scale searches) with

  family     --alpha family --no-scale-search   (a fixed alpha: the baseline)
  auto       --alpha auto --no-scale-search     (the alpha grid alone)
  default    the defaults: --alpha auto with --scale-search

each compiled once, then timed in --rounds rounds that alternate the modes; the
fastest round of each mode is reported (the machine is shared: the minimum is
the run least disturbed by other work), with its ratio to the fixed alpha. The random model is only for timing (its shapes are a real
model's hidden sizes, shrunk in depth).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import make_llama_checkpoint  # noqa: E402

from qconvert.options import ConvertOptions, CalibrationOptions  # noqa: E402
from qconvert.source.resolve import open_source, resolve_source  # noqa: E402
from qconvert.methods.recipe import prepare_adjustments  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
MODES = {"family": {"alpha": "family", "scale_search": False},
         "auto": {"alpha": "auto", "scale_search": False},
         "default": {}}


def time_stage(folder: Path, calib: str, samples: int, seqlen: int, flags: dict) -> float:
    flags = dict(flags)
    options = ConvertOptions(scheme="w8a8", scale_search=flags.pop("scale_search", None), calibration=CalibrationOptions(
        calib=calib, calib_samples=samples, calib_seqlen=seqlen, **flags))
    started = time.perf_counter()
    prepare_adjustments(open_source(resolve_source(str(folder))), options)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", choices=["all", "trained", "wide"], default="all")
    args = parser.parse_args()
    models = []
    trained = OUT / "llama-bytes"
    if args.models != "wide" and (trained / "model.safetensors").is_file():
        models.append(("trained byte Llama (hidden 256, 4 layers)", trained, str(trained / "train_sample.txt")))
    if args.models != "trained":
        tmp = Path(tempfile.mkdtemp())
        wide = make_llama_checkpoint(tmp / "wide", hidden=1024, intermediate=2816, layers=2, heads=16,
                                     kv_heads=4, vocab=512)
        models.append(("random Llama (hidden 1024, intermediate 2816, 2 layers)", wide, "random"))
    for label, folder, calib in models:
        for flags in MODES.values():
            time_stage(folder, calib, args.samples, args.seqlen, flags)  # compile
        times = {mode: float("inf") for mode in MODES}
        for _ in range(args.rounds):
            for mode, flags in MODES.items():
                times[mode] = min(times[mode], time_stage(folder, calib, args.samples, args.seqlen, flags))
        base = times["family"]
        print(f"{label}, {args.samples} x {args.seqlen} calibration tokens:")
        for mode, seconds in times.items():
            print(f"  {mode:8s} {seconds:7.2f} s  x{seconds / base:.2f} of a fixed alpha")


if __name__ == "__main__":
    main()
