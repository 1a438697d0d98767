"""End-to-end `qconvert quantize --scheme w8a8` on a 135M-shaped Llama, against a baseline tree.

    python bench/calibrate_e2e.py                       # this tree only
    python bench/calibrate_e2e.py --baseline DIR        # interleaved with another qconvert tree
    python bench/calibrate_e2e.py --quick               # 8 x 128 tokens, 4 layers

The checkpoint is random (tests/checkpoints.py make_llama_checkpoint) with the
shape of a 135M model: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate
1536, vocab 49152. Calibration draws `--calib random` ids. Each round runs the
CLI in a fresh process (compile and start-up included) with this tree and,
given --baseline, with the baseline tree right after, so both see the same
machine load; it prints wall and CPU seconds, peak RSS of the process, and
the ratios baseline / this tree (above 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from checkpoints import make_llama_checkpoint  # noqa: E402

SHAPE_135M = dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
SHAPE_QUICK = dict(hidden=576, layers=4, heads=9, kv_heads=3, intermediate=1536, vocab=4096)


def run_cli(tree: Path, model: Path, out: Path, samples: int, seqlen: int) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system) and peak RSS (MB) of one `qconvert quantize --scheme w8a8`
    in a fresh process. On a loaded machine the CPU seconds vary less than the wall time."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = ("import sys; from qconvert.cli.main import main; sys.argv=['qconvert']+sys.argv[1:]; main()")
    argv = [sys.executable, "-c", code, "quantize", str(model), "-o", str(out), "--scheme", "w8a8",
            "--calib", "random", "--calib-samples", str(samples), "--calib-seqlen", str(seqlen)]
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak RSS, in KB
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{tree}: exit {proc.returncode}: {err.read().decode()[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another qconvert source tree to compare against")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = SHAPE_QUICK if args.quick else SHAPE_135M
    samples, seqlen = (8, 128) if args.quick else (64, 512)
    with tempfile.TemporaryDirectory(prefix="qc-e2e-") as tmp:
        model = make_llama_checkpoint(Path(tmp) / "model", dtype="bfloat16", **shape)
        rows = []
        for r in range(args.rounds):
            trees = [("this tree", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
            for name, tree in trees:
                load = os.getloadavg()[0]
                seconds, cpu, rss = run_cli(tree, model, Path(tmp) / "out", samples, seqlen)
                rows.append((r, name, seconds, cpu, rss, load))
                print(f"round {r}: {name}: {seconds:.1f} s wall, {cpu:.1f} s CPU, peak RSS {rss:.0f} MB, "
                      f"load average before {load:.1f}", flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, {samples} x {seqlen} tokens, "
          f"shape {shape}")
    ours = [(s, c) for _, n, s, c, _, _ in rows if n == "this tree"]
    print(f"this tree: best {min(w for w, _ in ours):.1f} s wall, {min(c for _, c in ours):.1f} s CPU")
    if args.baseline:
        base = [(s, c) for _, n, s, c, _, _ in rows if n == "baseline"]
        wall = min(w for w, _ in base) / min(w for w, _ in ours)
        cpu = min(c for _, c in base) / min(c for _, c in ours)
        print(f"baseline: best {min(w for w, _ in base):.1f} s wall, {min(c for _, c in base):.1f} s CPU; "
              f"ratio baseline / this tree: {wall:.2f}x wall, {cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
