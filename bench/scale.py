"""Conversion at real model sizes: int8 and NF4 of a 3.6B- or 8B-shaped bf16 checkpoint against `cp -r`.

    python bench/scale.py                    # 3.6B shape (7.2 GB; largest tensor 788 MB)
    python bench/scale.py --size 8b          # the Llama-3-8B shape (16 GB)
    python bench/scale.py --size tiny        # a smoke run (a few MB)
    python bench/scale.py --w8a8 4 --verify  # also w8a8 (--calib random, 4 samples) and verify of the int8 output

A Llama-shaped bf16 checkpoint (untied head, grouped-query attention) is written
in 5 GB shards, as Hugging Face writes them, from a pool of a few MB of random
normal values tiled at a per-tensor offset: no full random draw per weight. Each
run is a child process: `cp -r` of the folder, then `qconvert quantize` int8 and
NF4, each followed by `sync` so every run ends with its bytes on disk. Each line:
seconds, input GB/s, the speed as a ratio to the copy's (1.0 = as fast as cp), and
the child's own peak RSS (wait4's ru_maxrss) against 1.5 x the largest tensor +
0.5 GB. This process imports only the standard library (the checkpoint is written
by a child too), so the few MB a child starts with, copied from it, do not
distort the children's peaks. The source stays in the page cache for every run (it was just written).
With --keep the generated folder stays for another run (--dir DIR reuses it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOL_VALUES = 1 << 22  # 8 MB of bf16 values, tiled over every tensor


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int


SIZES = {
    "3.6b": Shape(hidden=3072, layers=28, intermediate=8192, vocab=128256, heads=24, kv_heads=8),
    "8b": Shape(hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32, kv_heads=8),
    "tiny": Shape(hidden=256, layers=2, intermediate=768, vocab=4096, heads=4, kv_heads=2),
}


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    kv = shape.hidden // shape.heads * shape.kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, shape.hidden)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (shape.hidden,), f"{p}.post_attention_layernorm.weight": (shape.hidden,),
            f"{p}.self_attn.q_proj.weight": (shape.hidden, shape.hidden),
            f"{p}.self_attn.k_proj.weight": (kv, shape.hidden), f"{p}.self_attn.v_proj.weight": (kv, shape.hidden),
            f"{p}.self_attn.o_proj.weight": (shape.hidden, shape.hidden),
            f"{p}.mlp.gate_proj.weight": (shape.intermediate, shape.hidden),
            f"{p}.mlp.up_proj.weight": (shape.intermediate, shape.hidden),
            f"{p}.mlp.down_proj.weight": (shape.hidden, shape.intermediate),
        })
    shapes.update({"model.norm.weight": (shape.hidden,), "lm_head.weight": (shape.vocab, shape.hidden)})
    return shapes


def make_checkpoint(folder: Path, shape: Shape) -> None:
    """Write the checkpoint (layer order, 5 GB shards) and its config.json."""
    import ml_dtypes
    import numpy as np

    from qconvert.formats.safetensors_io import TensorSpec, write_shards

    pool = (np.random.default_rng(0).standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).astype(
        ml_dtypes.bfloat16)
    shapes = tensor_shapes(shape)
    specs = [TensorSpec(name, ml_dtypes.bfloat16, dims) for name, dims in shapes.items()]

    def tensors():
        for k, spec in enumerate(specs):
            if len(spec.shape) == 1:
                yield spec.name, np.ones(spec.shape, ml_dtypes.bfloat16)
                continue
            n = math.prod(spec.shape)
            start = (k * 7919) % POOL_VALUES  # a different phase of the pool for every tensor
            yield spec.name, np.resize(np.roll(pool, -start), n).reshape(spec.shape)

    folder.mkdir(parents=True)
    write_shards(folder, specs, tensors(), 5 * 10**9)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
              "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def run_child(argv: list[str]) -> tuple[float, int]:
    """Run a command to completion and then `sync`; returns (seconds, the command's own peak RSS in bytes)."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    errors = child.stderr.read().decode(errors="replace")
    child.stderr.close()
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({child.returncode}): {errors.strip()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024  # Linux reports kilobytes


def qconvert(*args: str) -> list[str]:
    return [sys.executable, "-c", "from qconvert.cli.entry import main; main()", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3.6b")
    parser.add_argument("--dir", default=None, help="work folder (default: a new one in the system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoint for another run")
    parser.add_argument("--workers", type=int, default=None, help="pass --workers N to qconvert quantize")
    parser.add_argument("--w8a8", type=int, default=0, metavar="SAMPLES",
                        help="also run w8a8 with --calib random and this many samples (0: skip)")
    parser.add_argument("--seqlen", type=int, default=64, help="tokens per w8a8 calibration sample")
    parser.add_argument("--verify", action="store_true", help="also time `qconvert verify --quick` of the int8 output")
    parser.add_argument("--generate-into", default=None, help=argparse.SUPPRESS)  # the generating child
    args = parser.parse_args()
    if args.generate_into:
        make_checkpoint(Path(args.generate_into), SIZES[args.size])
        return
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="qconvert-scale-"))
    source = work / f"src-{args.size}"
    shapes = tensor_shapes(SIZES[args.size])
    total = sum(math.prod(s) * 2 for s in shapes.values())
    largest = max(math.prod(s) * 2 for s in shapes.values())
    bound = 1.5 * largest + 0.5e9
    try:
        if not (source / "config.json").is_file():
            start = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--size", args.size, "--generate-into", str(source)], check=True)
            print(f"generated {source} in {time.perf_counter() - start:.1f} s")
        print(f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} usable CPUs, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
              f"{args.size}: {total / 1e9:.2f} GB bf16, largest tensor {largest / 1e6:.0f} MB; "
              f"RSS bound 1.5 x largest + 0.5 GB = {bound / 1e9:.2f} GB")
        extra = ["--workers", str(args.workers)] if args.workers else []
        runs = [("cp -r", ["cp", "-r", str(source), str(work / "out-cp")]),
                ("int8", qconvert("quantize", str(source), "-o", str(work / "out-int8"), "-q", *extra)),
                ("nf4", qconvert("quantize", str(source), "-o", str(work / "out-nf4"), "--scheme", "nf4", "-q",
                                 *extra))]
        if args.w8a8:
            runs.append(("w8a8", qconvert("quantize", str(source), "-o", str(work / "out-w8a8"), "--scheme", "w8a8",
                                          "--calib", "random", "--calib-samples", str(args.w8a8),
                                          "--calib-seqlen", str(args.seqlen), "-q", *extra)))
        if args.verify:
            runs.append(("verify", qconvert("verify", str(work / "out-int8"), "--quick")))
        copy_seconds = None
        for name, argv in runs:
            seconds, rss = run_child(argv)
            copy_seconds = seconds if copy_seconds is None else copy_seconds
            if name == "cp -r":
                shutil.rmtree(work / "out-cp")
            converts = name in ("int8", "nf4")
            speed = f"{copy_seconds / seconds:5.2f}x cp" if converts or name == "cp -r" else " " * 8
            within = (" (within the bound)" if rss <= bound else " (OVER the bound)") if converts else ""
            print(f"{name:6s} {seconds:8.1f} s  {total / 1e9 / seconds:5.2f} GB/s  {speed}  "
                  f"peak RSS {rss / 1e9:5.2f} GB{within}")
        for name in ("out-int8", "out-nf4", "out-w8a8"):
            shutil.rmtree(work / name, ignore_errors=True)
    finally:
        for name in ("out-cp", "out-int8", "out-nf4", "out-w8a8"):
            shutil.rmtree(work / name, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(source, ignore_errors=True)
            if not args.dir:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
