"""Time `qconvert verify` beside the float forward pass alone on the same tokens, as a ratio.

    python bench/verify.py [--model FOLDER] [--schemes int8,nf4,w8a8] [--quick] [--backend cpu]

Without --model a random tiny Llama (hidden 256, 2 layers) is written to a
temporary folder. Each scheme is converted once; then, in this process, the
float model's forward pass (layer by layer, as verify runs it) and a full
`verify_folder` run are timed, each after one warm-up run so compile time is
reported separately from the steady state. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from qconvert.convert import ConvertOptions, convert  # noqa: E402
from qconvert.formats.safetensors_io import open_checkpoint  # noqa: E402
from qconvert.hub import resolve_model  # noqa: E402
from qconvert.models import build, forward_layerwise  # noqa: E402
from qconvert.formats.checkpoint_params import CheckpointParams  # noqa: E402
from qconvert.verify.run import VerifyOptions, evaluation_tokens, verify_folder  # noqa: E402


def float_forward_seconds(source: Path, options: VerifyOptions) -> tuple[float, float]:
    """(first run, second run) seconds of the float forward on verify's evaluation tokens."""
    resolved = resolve_model(str(source))
    model = build(resolved.config)
    params = CheckpointParams(open_checkpoint(resolved.folder))
    ids = np.asarray(evaluation_tokens(options, resolved.folder, resolved.config).input_ids)
    mask = np.ones_like(ids)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        np.asarray(forward_layerwise(model, params, ids, mask, jit=False))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def verify_seconds(out: Path, options: VerifyOptions) -> tuple[float, float, bool]:
    """(first run, second run) seconds of verify_folder, and whether it passed."""
    times, passed = [], False
    for _ in range(2):
        start = time.perf_counter()
        report = verify_folder(out, options)
        times.append(time.perf_counter() - start)
        passed = report.passed
    return times[0], times[1], passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--schemes", default="int8,nf4,w8a8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qconvert-bench-verify-"))
    source = args.model
    if source is None:
        from checkpoints import make_llama_checkpoint

        source = make_llama_checkpoint(work / "src", hidden=256, layers=2, heads=4, kv_heads=2,
                                       intermediate=512, vocab=512)
    options = VerifyOptions(quick=args.quick, backend=args.backend, calib="auto")
    print(f"machine: {platform.machine()} {platform.processor() or ''}, devices {jax.devices()}, "
          f"jax {jax.__version__}, python {platform.python_version()}")
    print(f"model: {source}, evaluation: {'--quick' if args.quick else 'default'}, backend {args.backend}\n")
    print("| scheme | float fwd s (1st / 2nd) | verify s (1st / 2nd) | verify / float (2nd) | passed |")
    print("|---|---|---|---|---|")
    float_first, float_second = float_forward_seconds(source, options)
    for scheme in args.schemes.split(","):
        out = work / scheme
        convert(str(source), out, ConvertOptions(scheme=scheme))
        first, second, passed = verify_seconds(out, options)
        print(f"| {scheme} | {float_first:.2f} / {float_second:.2f} | {first:.2f} / {second:.2f} | "
              f"{second / float_second:.1f}x | {passed} |")


if __name__ == "__main__":
    main()
