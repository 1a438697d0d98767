"""Accuracy of each scheme and flag set: perplexity of a trained causal LM, pooled cosine of all-MiniLM-L6-v2.

    python bench/train_llama.py --out bench/out/llama-bytes     # once: ~5 minutes on a CPU
    python bench/accuracy.py                                    # both models, every configuration
    python bench/accuracy.py --only llm --configs w8a8-default,w8a8-family
    python bench/accuracy.py --configs int8,int4-g128,int4-g64,nf4   # the int4 table
    python bench/accuracy.py --only gguf --gguf-model /tmp/gemma3-270m \
        --configs int8,int4-g128,int4-g64,nf4                   # a real LM from a GGUF (bench/gguf_to_hf.py)
    python bench/accuracy.py --only llm --configs fp8,int8,w8a8-default,fp8-weights-only   # the fp8 table
    python bench/accuracy.py --only llm --configs fp8 --llm-folder /tmp/llama-bytes-FP8-Dynamic
    python bench/accuracy.py --only gguf --gguf-model /tmp/gemma3-270m --configs fp8,int8,w8a8-default,fp8-weights-only

Each configuration is converted with `qconvert quantize` (as a function, same
flags) into bench/out/accuracy/, then evaluated as a deployment computes it,
simulated here in float64-exact jnp: int8 / int4 / nf4 weights dequantized
from the folder (int4: the unpacked codes times each group's scale); w8a8
activations int8 per token (or per tensor with the folder's input_scale) times
the folder's int8 weights; fp8 weights dequantized from the folder (the e4m3
codes times each row's scale) and activations rounded per token to E4M3 as
the server does at run time (scale = max|x| / 448, round to nearest even,
saturated). The same evaluation runs on the float model.

- causal LM: perplexity on held-out text (bench/out/llama-bytes/heldout.txt,
  never seen in training), all its whole 256-token windows (a BOS and 255 bytes); calibration on a slice of the
  training text (train_sample.txt), 64 x 256 tokens.
- MiniLM: mean-pooled sentence embeddings of held-out sentences against the
  float ones (cosine, mean and worst); calibration on the built-in corpus.

Also printed per configuration: conversion seconds, and the scale searches'
target errors from qconvert.json (summed over the linears: before = plain
absmax scales, after = searched).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from qconvert.calibration.observer import open_params  # noqa: E402
from qconvert.convert import ConvertOptions, convert  # noqa: E402
from qconvert.formats.layouts import open_quantized  # noqa: E402
from qconvert.formats.qarray import QArray  # noqa: E402
from qconvert.models import build, dense_linear  # noqa: E402
from qconvert.calibration.tokenizer import load_tokenizer  # noqa: E402
from qconvert.options import CalibrationOptions  # noqa: E402
from qconvert.schemes.fp8 import FP8_MAX  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
HI = jax.lax.Precision.HIGHEST

# name -> (scheme, ConvertOptions extras, CalibrationOptions extras: calibration, smoothing); "family" and "auto
# --no-scale-search" are the explicit flags a user had before the defaults changed. Every row but the
# "-default" ones pins GPTQ (on: "-gptq") and AWQ (off), so that a name keeps its meaning whatever the defaults.
RTN, GPTQ = {"gptq": False, "awq": False}, {"gptq": True, "awq": False}
CONFIGS = {
    "int8": ("int8", RTN, None),
    "int8-scale-search": ("int8", {**RTN, "scale_search": True}, None),
    "int4-g128": ("int4", RTN, None),
    "int4-g128-scale-search": ("int4", {**RTN, "scale_search": True}, None),
    "int4-g64": ("int4", {**RTN, "group_size": 64}, None),
    "int4-g64-scale-search": ("int4", {**RTN, "group_size": 64, "scale_search": True}, None),
    "nf4": ("nf4", RTN, None),
    "nf4-scale-search": ("nf4", {**RTN, "scale_search": True}, None),
    "fp8": ("fp8", RTN, None),
    "fp8-weights-only": ("fp8", RTN, None),  # diagnostic: the fp8 folder's weights, activations left float
    "int8-gptq": ("int8", GPTQ, {}),
    "int4-g128-gptq": ("int4", GPTQ, {}),
    "nf4-gptq": ("nf4", GPTQ, {}),
    "fp8-gptq": ("fp8", GPTQ, {}),
    "int4-default": ("int4", {}, {}),
    "int4-g64-gptq": ("int4", {**GPTQ, "group_size": 64}, {}),
    "int4-g64-awq": ("int4", {**RTN, "group_size": 64, "awq": True}, {}),
    "int4-g64-awq-gptq": ("int4", {**GPTQ, "group_size": 64, "awq": True}, {}),
    "w8a8-default": ("w8a8", {}, {}),
    "w8a8-static-default": ("w8a8", {"act": "static"}, {}),
}
W8A8_SMOOTHING = {"no-smooth": {"smooth": False}, "family": {"alpha": "family"}, "alpha-0.5": {"alpha": "0.5"},
                  "auto": {"alpha": "auto"}}
for _label, _w8a8 in W8A8_SMOOTHING.items():
    for _search, _suffix in ((False, ""), (True, "-scale-search")):
        CONFIGS[f"w8a8-{_label}{_suffix}"] = ("w8a8", {**RTN, "scale_search": _search}, _w8a8)
        CONFIGS[f"w8a8-{_label}{_suffix}-gptq"] = ("w8a8", {**GPTQ, "scale_search": _search}, _w8a8)
for _act in ("static",):
    for _label in ("family", "auto"):
        for _search, _suffix in ((False, ""), (True, "-scale-search")):
            for _g, _gs in ((RTN, ""), (GPTQ, "-gptq")):
                CONFIGS[f"w8a8-{_act}-{_label}{_suffix}{_gs}"] = ("w8a8", {"act": _act, **_g, "scale_search": _search},
                                                                  W8A8_SMOOTHING[_label])


# Experiments on a search's internals: module attributes of qconvert.schemes.int8 set for one conversion.
SEARCH_PATCHES = {
    "w8a8-auto-scale-search-512rows": {"OUTPUT_ERROR_ROWS": 512},  # the clip search on all 512 sampled rows
}
SEARCH_PATCHES["w8a8-auto-scale-search-512rows-gptq"] = SEARCH_PATCHES["w8a8-auto-scale-search-512rows"]
CONFIGS["w8a8-auto-scale-search-512rows"] = CONFIGS["w8a8-auto-scale-search"]
CONFIGS["w8a8-auto-scale-search-512rows-gptq"] = CONFIGS["w8a8-auto-scale-search-gptq"]


def fp8_activations(x):
    """Each token rounded to E4M3 as the fp8 deployment does it at run time (FP8_DYNAMIC).

    scale = max|x| / 448 per token in float32 (1 for a zero row), codes = float8_e4m3fn(x / scale), round to
    nearest even, saturated at +-448 (the arithmetic of qconvert.schemes.fp8's folder_activations); returned
    as codes times scale.
    """
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / jnp.float32(FP8_MAX), jnp.float32(1)).astype(jnp.float32)
    codes = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return codes.astype(jnp.float32) * scale


def simulated_linear(quantized, float_activations: bool = False):
    """The deployment's arithmetic per quantized linear, in float32 at the highest precision.

    float_activations: leave the activations unquantized (to separate an fp8 folder's weight error from
    its activation rounding; no deployment computes this).
    """
    scheme = None if float_activations else quantized.scheme
    static = {}

    def linear(name, x, weight, bias):
        if not isinstance(weight, QArray):
            return dense_linear(name, x, weight, bias)
        w = weight.dequantize(jnp.float32)  # int4: codes at the logical shape times the group scales
        if w.shape != tuple(weight.shape):
            raise ValueError(f"{name}: dequantized to {w.shape}, expected {tuple(weight.shape)}")
        x = x.astype(jnp.float32)
        if scheme == "w8a8":
            module = name
            if module not in static:
                static[module] = quantized.input_scale(module)
            scale = static[module]
            if scale is None:
                scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0, 1e-12)
            x = jnp.clip(jnp.round(x / scale), -127, 127) * scale
        elif scheme in ("fp8", "w4a8-fp8"):  # both round activations to E4M3 per token at run time
            x = fp8_activations(x)
        y = jnp.matmul(x, w.T, precision=HI)
        return y if bias is None else y + jnp.asarray(bias, jnp.float32)

    return linear


def folder_params(folder: Path):
    q = open_quantized(folder)
    params = {name: np.asarray(q.get(name)) for name in q.float_names}
    params.update({f"{m}.weight": q.qarray(m) for m in q.quantized_modules})
    return q, params


def evaluate(model, params, windows: np.ndarray, linear=dense_linear, reference=None, batch: int = 8,
             per_window: list | None = None):
    """(perplexity, log-probs per batch, mean KL(reference || this) in nats or None); `per_window`, when given,
    receives each window's mean negative log-likelihood (for the standard error of a perplexity change)."""
    nll, count, kl, logps = 0.0, 0, 0.0, []
    for b, s in enumerate(range(0, len(windows), batch)):
        ids = jnp.asarray(windows[s:s + batch])
        logits = model.forward(params, ids, linear=linear).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        if reference is None:  # kept only as the reference of later runs (a 262k vocabulary makes them large)
            logps.append(logp)
        token_nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        if per_window is not None:
            per_window.extend(np.asarray(jnp.mean(token_nll, axis=1), np.float64).tolist())
        nll += float(jnp.sum(token_nll))
        count += int(ids[:, 1:].size)
        if reference is not None:
            kl += float(jnp.sum(jnp.exp(reference[b]) * (reference[b] - logp)))
    return float(np.exp(nll / count)), logps, (kl / count if reference is not None else None)


def change_standard_error(base: list[float], quantized: list[float]) -> float:
    """The standard error, in percent, of a perplexity change measured on these windows: the spread of the
    per-window log-likelihood differences over the square root of their count (windows, not tokens, are
    taken as independent)."""
    d = np.asarray(quantized) - np.asarray(base)
    return float(100 * np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def search_errors(folder: Path) -> dict[str, float]:
    """Summed target errors of the scale searches, before and after, from qconvert.json."""
    record = json.loads((folder / "qconvert.json").read_text()).get("scale_search") or {}
    sums = {}
    for r in (record.get("modules") or {}).values():
        for key, before, after in (("weight_clip", "error_plain", "error_searched"),
                                   ("input_scale", "error_max", "error_searched")):
            if key in r and before in r[key]:
                sums[f"{key}_before"] = sums.get(f"{key}_before", 0.0) + r[key][before]
                sums[f"{key}_after"] = sums.get(f"{key}_after", 0.0) + r[key][after]
    return sums


def config_of(name: str):
    """CONFIGS[name]; a GPTQ name may end in -damp<FRACTION> (--gptq-damp), e.g. int4-g128-gptq-damp0.1."""
    base, _, damp = name.rpartition("-damp")
    if base and base.endswith("-gptq") and base in CONFIGS:
        scheme, extra, w8a8 = CONFIGS[base]
        return scheme, {**extra, "gptq_damp": float(damp)}, w8a8
    return CONFIGS[name]


def run_convert(src: Path, out: Path, name: str, calib: str, samples: int, seqlen: int) -> float:
    scheme, extra, w8a8 = config_of(name)
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    if w8a8 is not None:
        extra = {**extra, "calibration": CalibrationOptions(calib=calib, calib_samples=samples, calib_seqlen=seqlen, **w8a8)}
    import qconvert.schemes.int8 as search

    saved = {k: getattr(search, k) for k in SEARCH_PATCHES.get(name, {})}
    try:
        for k, v in SEARCH_PATCHES.get(name, {}).items():
            setattr(search, k, v)
        convert(str(src), out, ConvertOptions(scheme=scheme, **extra))
    finally:
        for k, v in saved.items():
            setattr(search, k, v)
    return time.perf_counter() - started


def llm(configs: list[str], folders: list[Path] = ()) -> None:
    src = OUT / "llama-bytes"
    if not (src / "model.safetensors").is_file():
        sys.exit(f"{src} is missing: run python bench/train_llama.py --out {src} first")
    config = json.loads((src / "config.json").read_text())
    model = build(config)
    data = (src / "heldout.txt").read_bytes()
    n = len(data) // 255  # every whole 255-byte window of the held-out text
    windows = np.stack([np.concatenate([[256], np.frombuffer(data[i * 255:(i + 1) * 255], np.uint8)])
                        for i in range(n)]).astype(np.int32)
    base, reference, _ = evaluate(model, {k: np.asarray(v) for k, v in open_params(src).items()}, windows)
    print(f"causal LM {src.name}: float perplexity {base:.4f} on {windows.size} held-out tokens")
    for name in configs:
        out = OUT / "accuracy" / f"llm-{name}"
        seconds = run_convert(src, out, name, str(src / "train_sample.txt"), 64, 256)
        q, params = folder_params(out)
        ppl, _, kl = evaluate(model, params, windows, simulated_linear(q, name.endswith("weights-only")), reference)
        print(json.dumps({"model": "llm", "config": name, "perplexity": round(ppl, 4),
                          "change_pct": round(100 * (ppl / base - 1), 3), "mean_kl": float(f"{kl:.4g}"),
                          "convert_s": round(seconds, 2),
                          **{k: float(f"{v:.4g}") for k, v in search_errors(out).items()}}), flush=True)
    for folder in folders:  # quantized elsewhere (e.g. llm-compressor's FP8_DYNAMIC), evaluated the same way
        q, params = folder_params(folder)
        ppl, _, kl = evaluate(model, params, windows, simulated_linear(q), reference)
        print(json.dumps({"model": "llm", "folder": str(folder), "scheme": q.scheme, "perplexity": round(ppl, 4),
                          "change_pct": round(100 * (ppl / base - 1), 3), "mean_kl": float(f"{kl:.4g}")}), flush=True)


def held_out_text(fraction: float = 0.05) -> str:
    """The last `fraction` of Python's documentation topics (5%: the held-out tail of bench/train_llama.py's
    corpus; the real LLMs, which never trained on our split, are evaluated on a longer tail)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return text[int(len(text) * (1 - fraction)):]


def window_start(tokenizer, config: dict) -> int:
    """The token each evaluation window starts with: the model's document separator.

    A GPT-2-style vocabulary (SmolLM2) separates its training documents with <|endoftext|>, and its configured
    BOS is a chat token (<|im_start|>); otherwise the configured BOS (Gemma's <bos>).
    """
    separator = tokenizer.token_to_id("<|endoftext|>")
    return int(separator) if separator is not None else int(config.get("bos_token_id") or 2)


def gguf_llm(configs: list[str], src: Path, count: int, calib: str = "builtin", samples: int = 64,
             held_out: float = 0.05) -> None:
    """A real causal LM rebuilt from a GGUF (bench/gguf_to_hf.py): perplexity and KL on `count` held-out windows.

    Its weights keep the GGUF's block quantization, so only the differences between configurations mean
    anything. Calibration reads `calib` (qconvert's --calib: the built-in corpus by default), `samples` x 256
    tokens. Each converted folder is removed once evaluated (the float embedding makes them large).
    """
    from tokenizers import Tokenizer

    config = json.loads((src / "config.json").read_text())
    model = build(config)
    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokens = tokenizer.encode(held_out_text(held_out), add_special_tokens=False).ids
    bos = window_start(tokenizer, config)
    n = min(count, len(tokens) // 255)
    windows = np.asarray([[bos] + tokens[i * 255:(i + 1) * 255] for i in range(n)], np.int32)
    base_windows: list[float] = []
    base, reference, _ = evaluate(model, {k: np.asarray(v) for k, v in open_params(src).items()}, windows, batch=2,
                                  per_window=base_windows)
    print(f"causal LM {src.name}: float perplexity {base:.4f} on {windows.size} held-out tokens", flush=True)
    tag = "" if calib == "builtin" else f"-{Path(calib).stem}{samples}"  # folders apart per calibration
    for name in configs:
        out = OUT / "accuracy" / f"gguf-{src.name}{tag}-{name}"
        seconds = run_convert(src, out, name, calib, samples, 256)
        q, params = folder_params(out)
        quantized_windows: list[float] = []
        ppl, _, kl = evaluate(model, params, windows, simulated_linear(q, name.endswith("weights-only")), reference,
                              batch=2, per_window=quantized_windows)
        q.close()
        print(json.dumps({"model": src.name, "calib": f"{calib} x {samples}", "config": name,
                          "perplexity": round(ppl, 4), "change_pct": round(100 * (ppl / base - 1), 3),
                          "change_se_pct": round(change_standard_error(base_windows, quantized_windows), 3),
                          "mean_kl": float(f"{kl:.4g}"),
                          "convert_s": round(seconds, 2),
                          **{k: float(f"{v:.4g}") for k, v in search_errors(out).items()}}), flush=True)
        shutil.rmtree(out, ignore_errors=True)


def held_out_sentences(count: int = 64) -> list[str]:
    text = held_out_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s.strip()) <= 300]
    return sentences[:count]


def minilm(configs: list[str]) -> None:
    from checkpoints import minilm_path

    src = minilm_path()
    config = json.loads((src / "config.json").read_text())
    model = build(config)
    batch = load_tokenizer(src).encode(held_out_sentences(), seq_len=64)
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    reference = np.asarray(model.sentence_embeddings(open_params(src), ids, mask), np.float64)
    print(f"all-MiniLM-L6-v2: {len(ids)} held-out sentences")
    for name in configs:
        out = OUT / "accuracy" / f"minilm-{name}"
        seconds = run_convert(src, out, name, "builtin", 128, 128)
        q, params = folder_params(out)
        linear = simulated_linear(q, name.endswith("weights-only"))
        got = np.asarray(model.sentence_embeddings(params, ids, mask, linear=linear), np.float64)
        cos = np.sum(got * reference, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(reference, axis=-1))
        print(json.dumps({"model": "minilm", "config": name, "cosine_mean": round(float(cos.mean()), 6),
                          "cosine_min": round(float(cos.min()), 6), "convert_s": round(seconds, 2),
                          **{k: float(f"{v:.4g}") for k, v in search_errors(out).items()}}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["llm", "minilm", "gguf"], default=None)
    parser.add_argument("--gguf-model", type=Path, default=None,
                        help="a float folder made by bench/gguf_to_hf.py (evaluated with --only gguf)")
    parser.add_argument("--gguf-windows", type=int, default=16, help="held-out 256-token windows for --gguf-model")
    parser.add_argument("--gguf-calib", default="builtin",
                        help="--calib of the --gguf-model conversions (builtin, or a text file)")
    parser.add_argument("--gguf-held-out", type=float, default=0.05,
                        help="--gguf-model is evaluated on this last fraction of Python's documentation topics")
    parser.add_argument("--gguf-calib-samples", type=int, default=64, help="calibration windows of 256 tokens")
    parser.add_argument("--llm-folder", type=Path, action="append", default=[],
                        help="also evaluate this quantized folder of the byte Llama (made by another tool)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = []
    for c in configs:
        try:
            config_of(c)
        except (KeyError, ValueError):
            unknown.append(c)
    if unknown:
        sys.exit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    if args.only in (None, "llm"):
        llm(configs, args.llm_folder)
    if args.only in (None, "minilm"):
        minilm(configs)
    if args.only == "gguf":
        if args.gguf_model is None:
            sys.exit("--only gguf needs --gguf-model FOLDER (python bench/gguf_to_hf.py --out FOLDER)")
        gguf_llm(configs, args.gguf_model, args.gguf_windows, args.gguf_calib, args.gguf_calib_samples,
                  args.gguf_held_out)


if __name__ == "__main__":
    main()
