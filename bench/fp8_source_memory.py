"""Peak memory of a conversion from a block-FP8 source: int8 of a Qwen3-shaped FP8 checkpoint, against the bound
the README states for float sources.

    python bench/fp8_source_memory.py                  # the Qwen3-1.7B shape: 2.0 GB on disk (3.4 GB as bf16)
    python bench/fp8_source_memory.py --size 4b        # the Qwen3-4B shape: 4.4 GB on disk (8.0 GB as bf16)
    python bench/fp8_source_memory.py --size tiny      # a smoke run (a few MB)
    python bench/fp8_source_memory.py --float-copy     # also convert the same model as a bf16 checkpoint

A checkpoint in DeepSeek's block-FP8 form (config.json `quantization_config` {"quant_method": "fp8",
"weight_block_size": [128, 128]}; every decoder linear float8_e4m3fn with a float32 `weight_scale_inv` per
128 x 128 block; embeddings and norms bf16; tied head, as Qwen3-1.7B and -4B) is written by a child process in
2 GB shards, one tensor at a time, from a pool of a few MB of random e4m3 codes tiled at a per-tensor offset, so
neither this process nor the writer ever holds more than one tensor. Then, each as a child followed by `sync`,
`qconvert quantize` int8 of it (and with --float-copy: its dequantized bf16 copy, written by a child through
qconvert's own reader, and `qconvert quantize` int8 of that). Each line: seconds, and the child's own peak RSS
(wait4's ru_maxrss) against the README's float-source bound, 1.5 x the largest tensor + 0.5 GB, the largest
tensor counted as read (bf16), and that bound plus one linear's bf16 copy (what dequantizing while reading
may add). This process imports only the standard library.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import qconvert, run_child  # noqa: E402  (the same child runner and RSS reading as the float bench)

POOL_CODES = 1 << 23  # 8 MB of e4m3 codes, tiled over every fp8 weight
BLOCK = 128
SHARD_BYTES = 2 * 10**9


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int


SIZES = {
    "1.7b": Shape(hidden=2048, layers=28, intermediate=6144, vocab=151936, heads=16, kv_heads=8, head_dim=128),
    "4b": Shape(hidden=2560, layers=36, intermediate=9728, vocab=151936, heads=32, kv_heads=8, head_dim=128),
    "tiny": Shape(hidden=256, layers=2, intermediate=640, vocab=4096, heads=4, kv_heads=2, head_dim=64),
}


def tensor_shapes(shape: Shape) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor of the checkpoint: name -> (shape, stored in fp8)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    shapes = {"model.embed_tokens.weight": ((shape.vocab, shape.hidden), False)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": ((shape.hidden,), False),
            f"{p}.post_attention_layernorm.weight": ((shape.hidden,), False),
            f"{p}.self_attn.q_norm.weight": ((shape.head_dim,), False),
            f"{p}.self_attn.k_norm.weight": ((shape.head_dim,), False),
            f"{p}.self_attn.q_proj.weight": ((q, shape.hidden), True),
            f"{p}.self_attn.k_proj.weight": ((kv, shape.hidden), True),
            f"{p}.self_attn.v_proj.weight": ((kv, shape.hidden), True),
            f"{p}.self_attn.o_proj.weight": ((shape.hidden, q), True),
            f"{p}.mlp.gate_proj.weight": ((shape.intermediate, shape.hidden), True),
            f"{p}.mlp.up_proj.weight": ((shape.intermediate, shape.hidden), True),
            f"{p}.mlp.down_proj.weight": ((shape.hidden, shape.intermediate), True),
        })
    shapes["model.norm.weight"] = ((shape.hidden,), False)
    return shapes


def config_of(shape: Shape) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
            "hidden_act": "silu", "attention_bias": False,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK]}}


def make_checkpoint(folder: Path, shape: Shape) -> None:
    """Write the block-FP8 checkpoint (layer order, 2 GB shards, one tensor at a time) and its config.json."""
    import ml_dtypes
    import numpy as np

    from qconvert.formats.safetensors_io import TensorSpec, write_shards

    rng = np.random.default_rng(0)
    # Codes of N(0, 1) x 64 (within e4m3's +-448, no NaN); scales near 0.02 / 64, so weights are about N(0, 0.02).
    pool = (rng.standard_normal(POOL_CODES, dtype=np.float32) * 64).astype(ml_dtypes.float8_e4m3fn)
    bf16_pool = (rng.standard_normal(POOL_CODES, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    specs, fills = [], []
    for name, (dims, fp8) in tensor_shapes(shape).items():
        if fp8:
            specs += [TensorSpec(name, pool.dtype, dims),
                      TensorSpec(name + "_scale_inv", np.float32, (-(-dims[0] // BLOCK), -(-dims[1] // BLOCK)))]
            fills += [pool, None]
        else:
            specs.append(TensorSpec(name, ml_dtypes.bfloat16, dims))
            fills.append(bf16_pool if len(dims) == 2 else None)

    def tensors():
        for k, (spec, fill) in enumerate(zip(specs, fills)):
            if fill is None:
                values = (np.full(spec.shape, 0.02 / 64, np.float32) * rng.uniform(0.5, 1.5, spec.shape)
                          if spec.dtype == np.float32 else np.ones(spec.shape, spec.dtype))
                yield spec.name, values.astype(spec.dtype)
                continue
            start = (k * 7919) % POOL_CODES  # a different phase of the pool for every tensor
            yield spec.name, np.resize(np.roll(fill, -start), math.prod(spec.shape)).reshape(spec.shape)

    folder.mkdir(parents=True)
    write_shards(folder, specs, tensors(), SHARD_BYTES)
    (folder / "config.json").write_text(json.dumps(config_of(shape), indent=2) + "\n")


def make_float_copy(source: Path, folder: Path) -> None:
    """The source's dequantized bf16 copy, streamed tensor by tensor through qconvert's reader."""
    from qconvert.formats.dequantized_checkpoint import DequantizedCheckpoint
    from qconvert.formats.quantized_sources import source_format
    from qconvert.formats.safetensors_io import TensorSpec, open_checkpoint, write_shards

    config = json.loads((source / "config.json").read_text())
    with DequantizedCheckpoint(open_checkpoint(source), source_format(config.pop("quantization_config"))) as view:
        specs = [TensorSpec(name, view.dtype(name), view.shape(name)) for name in view.tensor_names]
        folder.mkdir(parents=True)
        write_shards(folder, specs, ((spec.name, view.get(spec.name)) for spec in specs), SHARD_BYTES)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1.7b")
    parser.add_argument("--dir", default=None, help="work folder (default: a new one in the system temp)")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints for another run")
    parser.add_argument("--float-copy", action="store_true",
                        help="also write the dequantized bf16 copy and convert it the same way")
    parser.add_argument("--generate-into", default=None, help=argparse.SUPPRESS)  # the generating child
    parser.add_argument("--copy-into", default=None, help=argparse.SUPPRESS)  # the child writing the bf16 copy
    args = parser.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="qconvert-fp8-source-"))
    source, copy = work / f"fp8-{args.size}", work / f"bf16-{args.size}"
    if args.generate_into:
        make_checkpoint(Path(args.generate_into), SIZES[args.size])
        return
    if args.copy_into:
        make_float_copy(source, Path(args.copy_into))
        return
    shapes = tensor_shapes(SIZES[args.size])
    as_read = {name: math.prod(dims) * 2 for name, (dims, _) in shapes.items()}  # bf16, as the reader gives them
    largest = max(as_read.values())
    largest_linear = max(as_read[name] for name, (_, fp8) in shapes.items() if fp8)
    bound = 1.5 * largest + 0.5e9
    try:
        for folder, flag in ((source, "--generate-into"), (copy, "--copy-into") if args.float_copy else (None, None)):
            if folder is not None and not (folder / "config.json").is_file():
                start = time.perf_counter()
                subprocess.run([sys.executable, __file__, "--size", args.size, "--dir", str(work), flag, str(folder)],
                               check=True)
                print(f"wrote {folder} ({folder_bytes(folder) / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
        print(f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} usable CPUs, "
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB; "
              f"{args.size}: {folder_bytes(source) / 1e9:.2f} GB block FP8 on disk, {sum(as_read.values()) / 1e9:.2f} "
              f"GB as read (bf16); largest tensor {largest / 1e6:.0f} MB, largest linear {largest_linear / 1e6:.0f} "
              f"MB as bf16; float-source bound 1.5 x largest + 0.5 GB = {bound / 1e9:.2f} GB "
              f"(+ one linear: {(bound + largest_linear) / 1e9:.2f} GB)")
        runs = [("int8 from FP8", source, work / "out-fp8")]
        if args.float_copy:
            runs.append(("int8 from bf16", copy, work / "out-bf16"))
        for name, folder, out in runs:
            seconds, rss = run_child(qconvert("quantize", str(folder), "-o", str(out), "-q"))
            within = "within the float bound" if rss <= bound else (
                "within the bound + one linear" if rss <= bound + largest_linear else "OVER the bound")
            print(f"{name:15s} {seconds:7.1f} s  {folder_bytes(folder) / 1e9 / seconds:5.2f} GB/s read  "
                  f"peak RSS {rss / 1e9:5.2f} GB ({within})")
            shutil.rmtree(out, ignore_errors=True)
    finally:
        for name in ("out-fp8", "out-bf16"):
            shutil.rmtree(work / name, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(source, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            if not args.dir:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
