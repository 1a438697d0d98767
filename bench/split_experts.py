"""A MoE conversion on several devices with its experts copied to each and split over them, side by side.

    python bench/split_experts.py [--devices 4] [--experts 32] [--hidden 256] [--expert-width 512] [--layers 2]
        [--samples 32] [--seqlen 128]

Builds a Qwen3-MoE-shaped float32 checkpoint with transformers (the tests' builder) once, then runs
`qconvert quantize --scheme int4 --no-awq` (GPTQ, random calibration ids) three ways, each a fresh process:

  one      1 device                                   (the bytes every run is compared with)
  copied   --devices forced CPU devices, --shard-experts never   (every device holds every expert)
  split    the same devices, --shard-experts always   (each device its own ceil(E / D) experts)

and prints each run's wall time and the process's peak resident memory (VmHWM, read by the process itself), the
split run's ratios to the copied one, and how many int4 codes differ from `one`'s. On a CPU every device's
arrays live in the one process, so the peak shows the experts (and their Hessians) held D times against once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# The process reports its own high-water mark: a child's ru_maxrss starts at its parent's.
_RUN = ("import sys\nfrom qconvert.cli.main import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as done:\n"
        "    code = done.code\nelse:\n    code = 0\n"
        "peak = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]) * 1024\n"
        "print('PEAK', peak, file=sys.stderr)\nsys.exit(code)\n")


def run(args: list[str], devices: int) -> tuple[float, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    environ["JAX_PLATFORMS"] = "cpu"
    if devices > 1:
        environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _RUN, *args], env=environ, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    peak = next(int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("PEAK "))
    return seconds, peak


def codes(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return {k: (v[..., None] >> np.arange(0, 32, 4)) & 15 for k, v in tensors.items() if k.endswith("_packed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=128)
    opts = parser.parse_args()
    from hf_checkpoints import make_hf_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = make_hf_checkpoint(tmp / "source", "qwen3_moe", hidden=opts.hidden, layers=opts.layers, heads=8,
                                    kv_heads=4, intermediate=opts.hidden * 2, vocab=1024, head_dim=32,
                                    num_experts=opts.experts, num_experts_per_tok=4,
                                    moe_intermediate_size=opts.expert_width)
        base = ["quantize", str(source), "--scheme", "int4", "--no-awq", "--calib", "random", "--calib-samples",
                str(opts.samples), "--calib-seqlen", str(opts.seqlen), "-q"]
        rows = {}
        for name, devices, flags in (("one", 1, []), ("copied", opts.devices, ["--shard-experts", "never"]),
                                     ("split", opts.devices, ["--shard-experts", "always"])):
            rows[name] = run([*base, *flags, "-o", str(tmp / name)], devices)
        reference = codes(tmp / "one")
        total = sum(v.size for v in reference.values())
        print(f"qwen3-moe-shaped: hidden {opts.hidden}, {opts.layers} layers of {opts.experts} experts "
              f"({opts.expert_width} wide, top 4), int4 GPTQ on {opts.samples} x {opts.seqlen} tokens; "
              f"{os.cpu_count()} cores")
        print(f"{'run':<7} {'devices':>7} {'seconds':>8} {'peak MB':>8} {'codes apart from one':>21}")
        for name, (seconds, peak) in rows.items():
            theirs = codes(tmp / name)
            apart = sum(int(np.sum(theirs[k] != v)) for k, v in reference.items())
            devices = 1 if name == "one" else opts.devices
            print(f"{name:<7} {devices:>7} {seconds:>8.1f} {peak / 2**20:>8.0f} {f'{apart:,} of {total:,}':>21}")
        (copied_s, copied_peak), (split_s, split_peak) = rows["copied"], rows["split"]
        print(f"split / copied: time {split_s / copied_s:.2f}x, peak memory {split_peak / copied_peak:.2f}x")
        print(json.dumps({name: {"seconds": round(s, 2), "peak_bytes": p} for name, (s, p) in rows.items()}))


if __name__ == "__main__":
    main()
