"""Conversion throughput and memory: int8 and NF4 beside a plain read-and-write-back copy, in one process.

    python bench/convert.py              # a 2 GB bf16 Llama-shaped checkpoint (the recorded run)
    python bench/convert.py --gb 0.2     # small, for a quick check
    python bench/convert.py --rounds 3   # copy/int8/nf4 three times over, and the median ratios

A synthetic bf16 checkpoint (hidden 2048, intermediate 5632, vocab 32000; as many
layers as the size asks for) is written into a temporary folder. Then, in this
process, each of: copy (every tensor read and written back unchanged, the same
reader and streaming writer), int8, NF4. Each line: seconds, MB/s of input, the
ratio to the copy's MB/s, and the peak RSS (total, and anonymous memory alone:
file-backed pages of the memory-mapped input count in RSS but are the page
cache's, not allocations) sampled every 5 ms during that phase. With --rounds,
the three phases repeat in turn (so a busy spell on a shared machine hits them
alike) and each ratio is taken against the copy of its own round.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from qconvert.convert import ConvertOptions, convert
from qconvert.formats.safetensors_io import TensorSpec, open_checkpoint, write_shards

HIDDEN, INTERMEDIATE, VOCAB, KV = 2048, 5632, 32000, 512


def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": (HIDDEN,), f"{p}.post_attention_layernorm.weight": (HIDDEN,),
        f"{p}.self_attn.q_proj.weight": (HIDDEN, HIDDEN), f"{p}.self_attn.k_proj.weight": (KV, HIDDEN),
        f"{p}.self_attn.v_proj.weight": (KV, HIDDEN), f"{p}.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        f"{p}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), f"{p}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
        f"{p}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
    }


def make_checkpoint(folder: Path, gigabytes: float) -> tuple[int, int]:
    """Write the synthetic checkpoint; returns (total bytes, largest tensor bytes)."""
    import json

    fixed = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
             "model.norm.weight": (HIDDEN,)}
    per_layer = sum(math.prod(s) * 2 for s in layer_shapes(0).values())
    layers = max(1, math.ceil((gigabytes * 1e9 - sum(math.prod(s) * 2 for s in fixed.values())) / per_layer))
    shapes = dict(fixed)
    for i in range(layers):
        shapes.update(layer_shapes(i))
    specs = [TensorSpec(name, ml_dtypes.bfloat16, shape) for name, shape in sorted(shapes.items())]
    rng = np.random.default_rng(0)

    def tensors():
        for spec in specs:
            yield spec.name, (rng.standard_normal(spec.shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    folder.mkdir(parents=True)
    write_shards(folder, specs, tensors(), 1 << 30)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers, "num_attention_heads": 16,
              "num_key_value_heads": 4, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return sum(s.nbytes for s in specs), max(s.nbytes for s in specs)


class PeakMemory:
    """Samples this process's RSS (total and anonymous) from /proc until stopped."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak_total, self.peak_anon = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon")))
        self.peak_total = max(self.peak_total, int(fields["VmRSS"].split()[0]) * 1024)
        self.peak_anon = max(self.peak_anon, int(fields["RssAnon"].split()[0]) * 1024)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def copy_checkpoint(source: Path, out: Path) -> None:
    """The baseline: read every tensor and write it back unchanged through the same reader and writer."""
    ckpt = open_checkpoint(source)
    specs = [TensorSpec(n, ckpt.dtype(n), ckpt.shape(n)) for n in ckpt.tensor_names]
    out.mkdir()
    write_shards(out, specs, ((n, ckpt.get(n)) for n in ckpt.tensor_names), 5 * 2**30)
    ckpt.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (bf16), default 2")
    parser.add_argument("--rounds", type=int, default=1, help="repeat copy/int8/nf4 this many times, default 1")
    parser.add_argument("--dir", default=None, help="where to put the temporary folders (default: system temp)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qconvert-bench-", dir=args.dir))
    try:
        source = work / "src"
        total, largest = make_checkpoint(source, args.gb)
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
              f"{platform.python_version()}; checkpoint {total / 1e9:.2f} GB bf16, largest tensor "
              f"{largest / 1e6:.0f} MB")
        phases = [("copy", lambda out: copy_checkpoint(source, out)),
                  ("int8", lambda out: convert(str(source), out, ConvertOptions(scheme="int8"))),
                  ("nf4", lambda out: convert(str(source), out, ConvertOptions(scheme="nf4")))]
        ratios: dict[str, list[float]] = {"int8": [], "nf4": []}
        copy_rate = float("nan")  # each round's copy runs first and sets it
        # The first copy warms the page cache and is not reported.
        for round_index, (name, run) in enumerate([(None, phases[0][1])] + phases * max(1, args.rounds)):
            out = work / f"out-{round_index}"
            with PeakMemory() as memory:
                start = time.perf_counter()
                run(out)
                seconds = time.perf_counter() - start
            shutil.rmtree(out)
            if name is None:
                continue
            rate = total / 1e6 / seconds
            copy_rate = rate if name == "copy" else copy_rate
            if name in ratios:
                ratios[name].append(rate / copy_rate)
            limit = 1.5 * largest + 500e6
            print(f"{name:5s} {seconds:7.2f} s  {rate:8.1f} MB/s  {rate / copy_rate:5.2f}x copy  "
                  f"peak RSS {memory.peak_total / 1e6:7.0f} MB (anon {memory.peak_anon / 1e6:6.0f} MB; "
                  f"target < {limit / 1e6:.0f} MB)")
        if args.rounds > 1:
            print("median vs copy: " + ", ".join(f"{k} {statistics.median(v):.2f}x" for k, v in ratios.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
