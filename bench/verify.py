"""Time `qconvert verify` beside the float forward pass alone on the same tokens, as a ratio.

    python bench/verify.py [--model FOLDER | --shape tiny|135m] [--schemes int8,nf4,w8a8] [--quick]
                           [--backends auto,cpu] [--runs 2]

Without --model a random Llama is written to a temporary folder: `tiny`
(hidden 256, 2 layers), or `135m`, the shape of a 135M LLM (hidden 576, 30
layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152, bf16, tied
embeddings). Each backend is timed on the same converted folders: `auto`
(on a CPU host the XLA contract path) against `cpu` (the TPU kernels in
interpret mode, what `auto` ran on CPU before). Each scheme is converted once; then, in this process, the
float model's forward pass (layer by layer, as verify runs it) and a full
`verify_folder` run are timed, each after one warm-up run so compile time is
reported separately from the steady state. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from qconvert.convert import ConvertOptions, convert  # noqa: E402
from qconvert.options import CalibrationOptions  # noqa: E402
from qconvert.formats.safetensors_io import open_checkpoint  # noqa: E402
from qconvert.source.hub import resolve_model  # noqa: E402
from qconvert.models import build  # noqa: E402
from qconvert.calibration.layers import forward_layerwise  # noqa: E402
from qconvert.formats.checkpoint_params import CheckpointParams  # noqa: E402
from qconvert.verify.run import VerifyOptions, evaluation_tokens, verify_folder  # noqa: E402


def float_forward_seconds(source: Path, options: VerifyOptions) -> tuple[float, float]:
    """(first run, second run) seconds of the float forward on verify's evaluation tokens."""
    resolved = resolve_model(str(source))
    model = build(resolved.config)
    params = CheckpointParams(open_checkpoint(resolved.folder))
    ids = np.asarray(evaluation_tokens(options, resolved.folder, resolved.config).data.input_ids)
    mask = np.ones_like(ids)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        np.asarray(forward_layerwise(model, params, ids, mask, jit=False))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def verify_seconds(out: Path, options: VerifyOptions, runs: int = 2) -> tuple[list[float], list[float], bool, str]:
    """Wall and CPU seconds (this process, all threads) of each verify_folder run, whether it passed,
    and the kernel backends its layers ran on. CPU seconds do not grow when other jobs share the cores."""
    times, cpu, passed, backend = [], [], False, ""
    for _ in range(runs):
        start, cpu_start = time.perf_counter(), time.process_time()
        report = verify_folder(out, options)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        passed, backend = report.passed, report.backend
    return times, cpu, passed, backend


SHAPES = {
    "tiny": dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=512),
    "135m": dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                 dtype="bfloat16", tie=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--schemes", default="int8,nf4,w8a8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backends", default="auto", help="comma-separated verify backends, e.g. auto,cpu")
    parser.add_argument("--runs", type=int, default=2, help="verify runs per scheme and backend (the first compiles)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qconvert-bench-verify-"))
    source = args.model
    if source is None:
        from checkpoints import make_llama_checkpoint

        source = make_llama_checkpoint(work / "src", **SHAPES[args.shape])
    backends = args.backends.split(",")
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"devices {jax.devices()}, jax {jax.__version__}, python {platform.python_version()}")
    print(f"model: {args.model or args.shape}, evaluation: {'--quick' if args.quick else 'default'}\n")
    print("| scheme | backend (layers ran on) | float fwd s (1st / 2nd) | verify wall s (each run) "
          "| verify CPU s (each run) | verify / float (last) | passed |")
    print("|---|---|---|---|---|---|---|")
    float_first, float_second = float_forward_seconds(source, VerifyOptions(quick=args.quick, calib="auto"))
    for scheme in args.schemes.split(","):
        out = work / scheme
        # w8a8 as plain per-token W8A8 (no calibration): what is timed is verify, not the conversion.
        plain = {"scale_search": False, "calibration": CalibrationOptions(smooth=False)} if scheme == "w8a8" else {}
        convert(str(source), out, ConvertOptions(scheme=scheme, **plain))
        for backend in backends:
            options = VerifyOptions(quick=args.quick, backend=backend, calib="auto")
            times, cpu, passed, ran_on = verify_seconds(out, options, args.runs)
            print(f"| {scheme} | {backend} ({ran_on}) | {float_first:.2f} / {float_second:.2f} | "
                  f"{' / '.join(f'{t:.1f}' for t in times)} | {' / '.join(f'{t:.1f}' for t in cpu)} | "
                  f"{times[-1] / float_second:.1f}x | {passed} |", flush=True)


if __name__ == "__main__":
    main()
