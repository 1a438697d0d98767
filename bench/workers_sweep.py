"""Peak RSS and wall time of `qconvert quantize --workers N` on a tiny checkpoint, N from 1 to 10^6.

    python bench/workers_sweep.py                   # the CLI (N above 4 per core is refused, exit 2)
    python bench/workers_sweep.py --uncapped 10000  # also convert() with the bound lifted, N up to 10000

Each run is a child process (`python -m qconvert.cli.main quantize MODEL -o OUT
--workers N -q`); its own peak RSS is wait4's ru_maxrss, so this process's
memory does not count. With --uncapped the child calls convert() directly with
the bound lifted, to show what the refused counts would cost: every worker is a
thread with its own stack and its share of the prefetch window. The checkpoint
is tests/checkpoints.py's tiny Llama (written once, by a child as well).
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
COUNTS = (1, 2, 4, 8, 16, 100, 1_000, 10_000, 100_000, 1_000_000)

UNCAPPED = """
import sys
from pathlib import Path
import qconvert.write.prefetch
from qconvert.convert import convert
from qconvert.options import ConvertOptions
qconvert.write.prefetch.max_workers = lambda: sys.maxsize
convert(sys.argv[1], Path(sys.argv[2]), ConvertOptions(workers=int(sys.argv[3])))
"""

MAKE_CHECKPOINT = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from checkpoints import make_llama_checkpoint
make_llama_checkpoint(sys.argv[1])
"""


def run_child(argv: list[str]) -> tuple[int, float, float]:
    """(exit code, seconds, peak RSS in MB) of one child process."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stderr.close()
    return child.returncode, seconds, usage.ru_maxrss / 1024  # ru_maxrss is in KB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uncapped", type=int, default=0, metavar="N",
                        help="also run convert() with the bound lifted, for counts up to N")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"# {platform.machine()}, {cores} cores, Python {platform.python_version()}; "
          f"cap 4 x {cores} = {4 * cores} workers")
    with tempfile.TemporaryDirectory(prefix="workers-sweep-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-c", MAKE_CHECKPOINT, str(model)], check=True)
        print(f"{'mode':9} {'workers':>9} {'exit':>4} {'seconds':>8} {'peak RSS MB':>12}")
        for mode in ("cli", "uncapped") if args.uncapped else ("cli",):
            for count in COUNTS:
                if mode == "uncapped" and count > args.uncapped:
                    break
                out = Path(tmp) / "out"
                shutil.rmtree(out, ignore_errors=True)
                argv = ([sys.executable, "-m", "qconvert.cli.main", "quantize", str(model), "-o", str(out),
                         "--workers", str(count), "-q"] if mode == "cli"
                        else [sys.executable, "-c", UNCAPPED, str(model), str(out), str(count)])
                code, seconds, rss = run_child(argv)
                print(f"{mode:9} {count:>9} {code:>4} {seconds:>8.2f} {rss:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
