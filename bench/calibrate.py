"""Calibration throughput and memory: qconvert's layer-by-layer statistics beside the same pass in transformers, in one process.

    python bench/calibrate.py            # the recorded run
    python bench/calibrate.py --quick    # fewer tokens, for a quick check

Two models: a tiny random Llama (hidden 256, 4 layers, GQA; written by the test
builders) and the real all-MiniLM-L6-v2 (BERT, hidden 384, 6 layers). For each:

  qconvert     collect_act_stats: weights read lazily, one layer at a time (one
               compiled program for all layers of a kind), per-channel max|x| of
               every linear's input.
  transformers the same forward in torch (float32, no_grad) over the same token
               batches, with forward pre-hooks on every nn.Linear keeping the same
               per-channel max|x|: the equivalent calibration pass.

Each line: seconds, tokens/s (first run, compile included; and warm, a second
run), the ratio of qconvert's warm tokens/s to transformers', and the peak RSS
above the RSS at the phase's start (sampled every 5 ms), beside qconvert's own
estimate of it (qconvert.calibration.memory, arrays only, without XLA's runtime). torch is used here only,
as the baseline; qconvert itself never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints import make_llama_checkpoint, minilm_path  # noqa: E402

from qconvert.calibration.data import load_calibration  # noqa: E402
from qconvert.calibration.memory import checkpoint_shapes, estimate  # noqa: E402
from qconvert.calibration.observer import collect_act_stats, open_params  # noqa: E402
from qconvert.models import build  # noqa: E402


COMPILE_SECONDS: list[float] = []


def _on_duration(event: str, seconds: float, **_) -> None:
    # Tracing, lowering and XLA compilation: everything jit does before the first run.
    if event.startswith("/jax/core/compile/"):
        COMPILE_SECONDS.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS above the starting RSS, sampled every 5 ms on a thread while the block runs."""

    def __enter__(self):
        self.start, self.peak, self._stop = rss_bytes(), rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def run_qconvert(folder: Path, config: dict, ids: np.ndarray, batch: int) -> dict:
    model, params = build(config), open_params(folder)
    COMPILE_SECONDS.clear()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        stats = collect_act_stats(model, params, ids, batch_size=batch)
        total = time.perf_counter() - t0
    # One program per kind of layer, compiled once per call: a fixed cost that long runs amortize.
    compile_s = sum(COMPILE_SECONDS)
    est = estimate(checkpoint_shapes(model, params), len(ids), ids.shape[1], batch)
    return {"total_s": total, "compile_s": compile_s, "steady_s": max(total - compile_s, 1e-9),
            "rss_mb": mem.delta_mb, "estimate_mb": (est.device_bytes + est.host_bytes) / 2**20,
            "linears": len(stats.act_absmax)}


def run_transformers(folder: Path, family: str, ids: np.ndarray, batch: int) -> dict:
    import torch
    import transformers

    with PeakRSS() as mem:
        cls = transformers.LlamaForCausalLM if family == "llama" else transformers.BertModel
        model = cls.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
        act_absmax: dict[str, torch.Tensor] = {}

        def hook(name):
            def record(module, inputs):
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(0)
                act_absmax[name] = x if name not in act_absmax else torch.maximum(act_absmax[name], x)
            return record

        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(hook(name))
        with torch.no_grad():
            model(input_ids=torch.from_numpy(ids[:1]).long())  # warm-up
            t0 = time.perf_counter()
            for s in range(0, len(ids), batch):
                model(input_ids=torch.from_numpy(ids[s:s + batch]).long())
            total = time.perf_counter() - t0
    return {"total_s": total, "rss_mb": mem.delta_mb, "linears": len(act_absmax)}


def bench(name: str, folder: Path, family: str, samples: int, seqlen: int, batch: int) -> dict:
    config = json.loads((folder / "config.json").read_text())
    calib = "builtin" if (folder / "tokenizer.json").is_file() else "random"
    ids = load_calibration(calib, folder, config, samples=samples, seqlen=seqlen).input_ids
    if len(ids) < samples:  # the built-in corpus is short: repeat its windows to the asked count
        ids = np.concatenate([ids] * (-(-samples // len(ids))))[:samples]
    samples = len(ids) - len(ids) % batch
    ids = ids[:samples]
    tokens = int(ids.size)
    ckpt = open_params(folder).checkpoint
    params_m = sum(int(np.prod(ckpt.shape(n))) for n in ckpt.tensor_names) / 1e6
    name = f"{name}, {params_m:.1f}M params"
    ours = run_qconvert(folder, config, ids, batch)
    theirs = run_transformers(folder, family, ids, batch)
    return {"model": name, "tokens": tokens, "samples": int(len(ids)), "seqlen": int(ids.shape[1]),
            "batch": batch, "qconvert": ours, "transformers": theirs,
            "tok_s_qconvert": tokens / ours["total_s"], "tok_s_qconvert_steady": tokens / ours["steady_s"],
            "tok_s_transformers": tokens / theirs["total_s"],
            "ratio": theirs["total_s"] / ours["total_s"], "ratio_steady": theirs["total_s"] / ours["steady_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    args = parser.parse_args()
    samples = 8 if args.quick else 32
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_llama_checkpoint(Path(tmp) / "tiny", hidden=256, layers=4, heads=8, kv_heads=2,
                                     intermediate=688, vocab=1024, outlier_channels=(7,))
        results = [bench("tiny Llama (h256, 4 layers)", tiny, "llama", samples, 256, 8),
                   bench("all-MiniLM-L6-v2 (h384, 6 layers)", minilm_path(), "bert",
                         samples, 256, 8)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| model | tokens | qconvert tok/s (all; without compile) | compile s | transformers tok/s "
          "| ratio (all; without compile) | peak RSS qconvert / transformers | qconvert's estimate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['tokens']} ({r['samples']}x{r['seqlen']}) "
              f"| {r['tok_s_qconvert']:.0f}; {r['tok_s_qconvert_steady']:.0f} "
              f"| {r['qconvert']['compile_s']:.1f} | {r['tok_s_transformers']:.0f} "
              f"| {r['ratio']:.2f}; {r['ratio_steady']:.2f} "
              f"| {r['qconvert']['rss_mb']:.0f} MB / {r['transformers']['rss_mb']:.0f} MB "
              f"| {r['qconvert']['estimate_mb']:.0f} MB |")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
