"""What an FP8 (E4M3) KV cache costs a causal LM: calibrated per-tensor scales against scale 1.0.

    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    qconvert quantize /tmp/smollm2-135m -o /tmp/smollm2-135m-fp8-kv --scheme fp8 --kv-cache fp8
    python bench/kv_cache_accuracy.py --model /tmp/smollm2-135m --windows 64 --fp8-folder /tmp/smollm2-135m-fp8-kv
    python bench/kv_cache_accuracy.py --model /tmp/gemma3-270m --windows 24    # the float rows only

The float model is evaluated on bench/accuracy.py's held-out text (the last `--held-out` of Python's
documentation topics, windows of the model's document separator and 255 tokens), then again with every
attention block's keys (after RoPE) and values rounded as an FP8 E4M3 cache stores them
(qconvert.verify.kv_cache.fp8_cache: x / scale saturated to +-448, rounded to E4M3, times scale), through the
models.hooks.cached_kv tap (one jit-compiled forward per row kind; the scales are its arguments), with

- calibrated scales: per block, k_scale = max|k| / 448 and v_scale = max|v| / 448 (formats.kv_cache.kv_scale),
  the maxima from qconvert's own statistic (calibration.statistics.AttentionAbsMax through
  calibration.observer.iter_layer_stats, beside InputAbsMax as in quantize) on `--calib` (the built-in corpus,
  quantize's default 128 x 512 asked), i.e. what `qconvert quantize --kv-cache fp8` writes;
- every scale 1.0: what a server uses when a checkpoint carries no scales (vLLM's default).

With `--fp8-folder` (a `--scheme fp8 --kv-cache fp8` conversion of the same model), its k_scale / v_scale are
checked bit for bit against the ones computed here, and the folder is evaluated too, with and without the
cache rounding (fp8 weights and per-token E4M3 activations simulated as bench/accuracy.py does).

Every row is judged against the float model on the same windows: mean KL(float || row) in nats per token, top-1
agreement (the row's most likely next token equals the float model's), perplexity and its ratio to the float
model's with the standard error of the change (per-window log-likelihood differences, windows independent), and
the share of cached elements that saturate (|x| / scale > 448) or fall below E4M3's normal range
(|x| / scale < 2^-6, where fewer than 3 mantissa bits are left; zeros not counted). Then scale 1.0 against the
calibrated scales directly (`pair`): the mean KL difference and the perplexity ratio, each with the standard error
of the per-window differences.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy  # noqa: E402  (bench/accuracy.py: the held-out text, window start, fp8 linear simulation)
from qconvert.calibration.data import load_calibration  # noqa: E402
from qconvert.calibration.observer import iter_layer_stats, open_params  # noqa: E402
from qconvert.calibration.statistics import AttentionAbsMax, InputAbsMax  # noqa: E402
from qconvert.formats.kv_cache import FP8_E4M3_MAX, kv_scale  # noqa: E402
from qconvert.methods.kv_cache import attention_blocks  # noqa: E402
from qconvert.models import build, dense_linear  # noqa: E402
from qconvert.models.hooks import kv_tap  # noqa: E402
from qconvert.verify.kv_cache import fp8_cache  # noqa: E402

E4M3_MIN_NORMAL = 2.0 ** -6


def calibrated_absmax(model, folder: Path, config: dict, calib: str, samples: int, seqlen: int):
    """Per attention block, (max|k|, max|v|) on the calibration windows, as `quantize --kv-cache fp8` finds them."""
    data = load_calibration(calib, folder, config, samples=samples, seqlen=seqlen)
    blocks = attention_blocks(model)
    absmax = {}
    # InputAbsMax too, as quantize's calibration loop always asks it: what else a layer's trace observes changes
    # XLA's fusion, and with it the maxima in their last float32 bits (on Gemma 3; not on SmolLM2).
    for stats in iter_layer_stats(model, open_params(folder), data.input_ids,
                                  statistics=[InputAbsMax(), AttentionAbsMax(frozenset(blocks))]):
        for name, pair in stats.of(AttentionAbsMax).items():
            absmax[name] = (float(pair["keys"]), float(pair["values"]))
    missing = [b for b in blocks if b not in absmax]
    if missing:
        raise SystemExit(f"calibration gave no keys or values for {missing[0]}")
    return blocks, absmax, data


def scale_arrays(blocks, absmax=None):
    """{block: (k_scale, v_scale)} as float32 scalars: formats.kv_cache.kv_scale of the maxima, or 1.0."""
    if absmax is None:
        return {b: (np.float32(1.0), np.float32(1.0)) for b in blocks}
    return {b: (kv_scale(absmax[b][0])[0], kv_scale(absmax[b][1])[0]) for b in blocks}


def make_forward(model, linear=dense_linear, rounded: bool = False):
    """A jitted forward(params, scales, ids) -> (log-probs of the next token [B, T-1, V], cache counts).

    rounded: every block's keys and values pass through fp8_cache with its (traced) scales, so one program
    serves every set of scales; the counts are [saturated, subnormal, nonzero] summed over all blocks.
    """

    def forward(params, scales, ids):
        counts = []

        def tap(name, keys, values):
            k_scale, v_scale = scales[name]
            for x, s in ((keys, k_scale), (values, v_scale)):
                r = jnp.abs(x.astype(jnp.float32) / s)
                counts.append(jnp.stack([jnp.sum(r > FP8_E4M3_MAX), jnp.sum((r < E4M3_MIN_NORMAL) & (r > 0)),
                                         jnp.sum(r > 0)]).astype(jnp.float32))
            return fp8_cache(keys, k_scale), fp8_cache(values, v_scale)

        with kv_tap(tap if rounded else None):
            logits = model.forward(params, ids, linear=linear).astype(jnp.float32)
        total = jnp.sum(jnp.stack(counts), axis=0) if counts else jnp.zeros(3, jnp.float32)
        return jax.nn.log_softmax(logits[:, :-1], axis=-1), total

    return jax.jit(forward)


class Tally:
    """One row's sums against the float model."""

    def __init__(self):
        self.kl = self.agree = self.count = 0.0
        self.window_nll: list[float] = []
        self.window_kl: list[float] = []
        self.cache = np.zeros(3)
        self.seconds = 0.0

    def add(self, logp, ref, ids, counts=None):
        target = ids[:, 1:]
        token_nll = -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        self.window_nll.extend(np.asarray(jnp.mean(token_nll, axis=1), np.float64).tolist())
        self.count += int(target.size)
        if ref is not None:
            token_kl = jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1)
            self.window_kl.extend(np.asarray(jnp.mean(token_kl, axis=1), np.float64).tolist())
            self.kl += float(jnp.sum(token_kl))
            self.agree += float(jnp.sum(jnp.argmax(logp, -1) == jnp.argmax(ref, -1)))
        if counts is not None:
            self.cache += np.asarray(counts, np.float64)

    def row(self, name: str, base: "Tally | None") -> dict:
        ppl = float(np.exp(np.mean(self.window_nll)))  # equal-length windows: the token mean
        out = {"row": name, "perplexity": round(ppl, 4)}
        if base is not None:
            base_ppl = float(np.exp(np.mean(base.window_nll)))
            out.update({"ppl_ratio": round(ppl / base_ppl, 5),
                        "change_se_pct": round(accuracy.change_standard_error(base.window_nll, self.window_nll), 3),
                        "mean_kl": float(f"{self.kl / self.count:.4g}"),
                        "top1_agreement": round(self.agree / self.count, 5)})
        if self.cache[2] > 0:
            out.update({"cache_saturated": float(f"{self.cache[0] / self.cache[2]:.3g}"),
                        "cache_below_normal": float(f"{self.cache[1] / self.cache[2]:.3g}")})
        out["seconds"] = round(self.seconds, 1)
        return out


def paired(a: Tally, b: Tally) -> dict:
    """Row b against row a on the same windows: the mean KL difference and the perplexity ratio, each with the
    standard error of the per-window differences (windows independent)."""
    dkl = np.asarray(b.window_kl) - np.asarray(a.window_kl)
    dnll = np.asarray(b.window_nll) - np.asarray(a.window_nll)
    se = lambda d: float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")  # noqa: E731
    return {"kl_difference": float(f"{dkl.mean():.4g}"), "kl_difference_se": float(f"{se(dkl):.2g}"),
            "ppl_ratio": round(float(np.exp(dnll.mean())), 5), "log_ppl_ratio_se": float(f"{se(dnll):.2g}")}


def folder_scales(folder: Path, blocks) -> dict:
    """The converted folder's k_scale / v_scale by block (float32 scalars)."""
    from qconvert.formats.layouts import open_quantized

    q = open_quantized(folder)
    try:
        return {b: (np.asarray(q.get(f"{b}.k_scale"), np.float32).ravel()[0],
                    np.asarray(q.get(f"{b}.v_scale"), np.float32).ravel()[0]) for b in blocks}
    finally:
        q.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a float folder (bench/gguf_to_hf.py)")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    parser.add_argument("--held-out", type=float, default=0.2, help="last fraction of Python's documentation topics")
    parser.add_argument("--batch", type=int, default=2, help="windows per forward")
    parser.add_argument("--calib", default="builtin", help="calibration text of the scales (quantize's --calib)")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument("--fp8-folder", type=Path, default=None,
                        help="a --scheme fp8 --kv-cache fp8 conversion of --model: scales checked, rows (c) added")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}", flush=True)

    from tokenizers import Tokenizer

    src = args.model
    config = json.loads((src / "config.json").read_text())
    model = build(config)

    started = time.perf_counter()
    blocks, absmax, calib = calibrated_absmax(model, src, config, args.calib, args.calib_samples, args.calib_seqlen)
    print(f"calibrated {len(blocks)} blocks on {calib.description}: {calib.input_ids.shape[0]} x "
          f"{calib.input_ids.shape[1]} tokens in {time.perf_counter() - started:.1f} s; max|k| "
          f"{min(a[0] for a in absmax.values()):.3g}..{max(a[0] for a in absmax.values()):.3g}, max|v| "
          f"{min(a[1] for a in absmax.values()):.3g}..{max(a[1] for a in absmax.values()):.3g}", flush=True)
    calibrated, unit = scale_arrays(blocks, absmax), scale_arrays(blocks)

    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokens = tokenizer.encode(accuracy.held_out_text(args.held_out), add_special_tokens=False).ids
    start = accuracy.window_start(tokenizer, config)
    n = min(args.windows, len(tokens) // 255)
    n -= n % args.batch
    windows = np.asarray([[start] + tokens[i * 255:(i + 1) * 255] for i in range(n)], np.int32)
    print(f"evaluation: {n} windows x 256 tokens of the last {args.held_out:g} of Python's documentation topics",
          flush=True)

    float_params = {k: jnp.asarray(np.asarray(v)) for k, v in open_params(src).items()}
    plain, kv = make_forward(model), make_forward(model, rounded=True)
    rows = {"float": (plain, float_params, calibrated), "kv fp8, calibrated scales": (kv, float_params, calibrated),
            "kv fp8, scale 1.0": (kv, float_params, unit)}
    fp8_q = None
    if args.fp8_folder is not None:
        stored = folder_scales(args.fp8_folder, blocks)
        differ = [b for b in blocks if stored[b][0].tobytes() != calibrated[b][0].tobytes()
                  or stored[b][1].tobytes() != calibrated[b][1].tobytes()]
        print(f"{args.fp8_folder}: k_scale / v_scale "
              + ("equal bit for bit to the ones calibrated here" if not differ else
                 f"differ from the ones calibrated here in {len(differ)} blocks (first {differ[0]})"), flush=True)
        fp8_q, fp8_params = accuracy.folder_params(args.fp8_folder)
        fp8_linear = accuracy.simulated_linear(fp8_q)
        fp8_kv = make_forward(model, fp8_linear, rounded=True)
        rows["fp8 weights+activations"] = (make_forward(model, fp8_linear), fp8_params, stored)
        rows["fp8 w+a, kv fp8 folder scales"] = (fp8_kv, fp8_params, stored)
        rows["fp8 w+a, kv fp8 scale 1.0"] = (fp8_kv, fp8_params, unit)

    tallies = {name: Tally() for name in rows}
    for s in range(0, n, args.batch):
        ids = jnp.asarray(windows[s:s + args.batch])
        ref = None
        for name, (forward, params, scales) in rows.items():
            t0 = time.perf_counter()
            logp, counts = forward(params, scales, ids)
            logp.block_until_ready()
            tallies[name].seconds += time.perf_counter() - t0
            tallies[name].add(logp, ref, ids, counts if "kv" in name else None)
            if name == "float":
                ref = logp
        print(f"  {s + args.batch}/{n} windows", flush=True)
    if fp8_q is not None:
        fp8_q.close()

    base = tallies["float"]
    print(f"{src.name}: float perplexity {float(np.exp(np.mean(base.window_nll))):.4f} on {windows.size} tokens")
    results = [tallies[name].row(name, None if name == "float" else base) for name in rows]
    for r in results:
        print(json.dumps(r), flush=True)
    for a, b in (("kv fp8, calibrated scales", "kv fp8, scale 1.0"),
                 ("fp8 w+a, kv fp8 folder scales", "fp8 w+a, kv fp8 scale 1.0")):
        if a in tallies and b in tallies:
            print(json.dumps({"pair": f"{b} against {a}", **paired(tallies[a], tallies[b])}), flush=True)
    print("\n| row | mean KL vs float (nats) | top-1 agreement | perplexity | ratio (± s.e.) | saturated | "
          "below normal |\n|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['ppl_ratio']:.4f} (± {r['change_se_pct'] / 100:.4f})" if "ppl_ratio" in r else "1"
        print(f"| {r['row']} | {r.get('mean_kl', 0):.4g} | {r.get('top1_agreement', 1):.4f} | {r['perplexity']:.4f} "
              f"| {ratio} | {r.get('cache_saturated', '')} | {r.get('cache_below_normal', '')} |")


if __name__ == "__main__":
    main()
