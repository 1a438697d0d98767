"""One calibrating conversion as one process and as several (jax.distributed on 127.0.0.1), side by side.

    python bench/distributed.py [--hidden 512] [--layers 4] [--samples 64] [--seqlen 128] [--scheme int4]
        [--awq | --no-awq]

Builds a Llama-shaped bfloat16 checkpoint (the tests' builder) once, then runs `qconvert quantize` (GPTQ on,
random calibration ids) three ways, each a fresh set of processes:

  one      1 process, 1 device                 (the baseline)
  devices  1 process, 2 devices                (the batches and GPTQ's groups over a local mesh)
  procs    2 processes x 1 device (gloo)       (the same over jax.distributed)

and prints each one's wall time, its ratio to `one` (> 1: faster), whether its files are byte-identical to
`one`'s, and each phase (calibrated, wrote) from `--json`. Every process shares the machine's cores: on a host
with few cores the ratio shows the cost of the collectives more than the spread of the work.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def env(devices: int) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    environ["JAX_PLATFORMS"] = "cpu"
    if devices > 1:
        environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return environ


def qconvert(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "from qconvert.cli.entry import main; main()", *args]


def run(args: list[str], processes: int, devices: int) -> tuple[float, dict]:
    started = time.perf_counter()
    if processes == 1:
        done = subprocess.run(qconvert(args), env=env(devices), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr)
        return time.perf_counter() - started, json.loads(done.stdout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(qconvert([*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                        str(processes), "--process-id", str(i)]),
                              env=env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]
    outputs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("\n".join(err for _, err in outputs))
    return time.perf_counter() - started, json.loads(outputs[0][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--scheme", default="int4")
    parser.add_argument("--awq", action=argparse.BooleanOptionalAction, default=None,
                        help="AWQ before GPTQ (default: the scheme's own default; --no-awq: GPTQ alone)")
    opts = parser.parse_args()
    from checkpoints import make_llama_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = tmp / "source"
        make_llama_checkpoint(source, hidden=opts.hidden, layers=opts.layers, heads=8, kv_heads=4,
                              intermediate=opts.hidden * 11 // 4, vocab=1024, dtype="bfloat16")
        base = ["quantize", str(source), "--scheme", opts.scheme, "--gptq", "--calib", "random",
                "--calib-samples", str(opts.samples), "--calib-seqlen", str(opts.seqlen), "--json",
                *([] if opts.awq is None else ["--awq" if opts.awq else "--no-awq"])]
        rows, reference = [], None
        for name, processes, devices in (("one", 1, 1), ("devices", 1, 2), ("procs", 2, 1)):
            out = tmp / name
            seconds, summary = run([*base, "-o", str(out)], processes, devices)
            same = reference is None or files(out) == reference
            reference = reference or files(out)
            rows.append((name, processes, devices, seconds, same, summary["phases"]))
        baseline = rows[0][3]
        recipe = {None: "the scheme's default", True: "AWQ then GPTQ", False: "GPTQ alone"}[opts.awq]
        print(f"llama-shaped hidden {opts.hidden}, {opts.layers} layers, {opts.scheme} ({recipe}), "
              f"{opts.samples} x {opts.seqlen} tokens; {os.cpu_count()} cores")
        print(f"{'run':<8} {'procs':>5} {'dev/proc':>8} {'seconds':>8} {'one/run':>8} {'same bytes':>10}  phases")
        for name, processes, devices, seconds, same, phases in rows:
            print(f"{name:<8} {processes:>5} {devices:>8} {seconds:>8.1f} {baseline / seconds:>8.2f} "
                  f"{'yes' if same else 'NO':>10}  " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))


if __name__ == "__main__":
    main()
