"""vLLM TPU's own loading of a folder's FP8 KV-cache scales (`--kv-cache fp8`): loaded, kept, and what it uses.

../shared/vllm-tpu/tpu_accept.py runs tpu-inference 0.32's own loading on CPU (JAX_PLATFORMS=cpu, a 1x1 CPU mesh)
and exempts the attention layers' q/k/v/prob scales from its checks. This script loads the folder the same way
(it imports tpu_accept.py for the platform, config, mesh, load tracking and the get_model call TPUModelRunner makes)
and checks the KV-cache scales on each path:

  engine            EngineArgs(model=OUT, kv_cache_dtype=D).create_engine_config(): the cache_config TPUModelRunner
                    sizes its KV cache from (tpu_runner.py: `cache_dtype = self.cache_config.cache_dtype; if
                    cache_dtype == "auto": cache_dtype = self.dtype`).
  vllm path         (MODEL_IMPL_TYPE=vllm, and auto where it falls back): vLLM's model class under tpu-inference's
                    VllmCompressedTensorsConfig, whose get_quant_method gives each Attention layer vLLM's
                    CompressedTensorsKVCacheMethod; vLLM's DefaultModelLoader with the parameters pre-filled with -3.
    kv.scheme       the quant config holds the folder's kv_cache_scheme.
    kv.method       every Attention layer has a BaseKVCacheMethod.
    kv.consumed     each checkpoint k_scale / v_scale reached its Attention parameter's weight_loader (vLLM's
                    get_cache_scale_mapper: `self_attn.k_scale` -> `self_attn.attn.k_scale`), bit for bit, and every
                    layer got both.
    kv.loaded       after loading, processing and shard_model_to_tpu: each Attention layer's `_k_scale_float` /
                    `_v_scale_float` (what tpu-inference's attention impl passes to quantize_kv and the kernel) and
                    the `..._k_scale` / `..._v_scale` JAX arrays equal the folder's values bit for bit.
    kv.cache_dtype  each layer's kv_cache_dtype / impl.kv_cache_quantized_dtype (layers/vllm/backends/flash_attn.py:
                    `if kv_cache_dtype != "auto": self.kv_cache_quantized_dtype = to_jax_dtype(kv_cache_dtype)`)
                    against the runner's cache dtype. The layers are built from a deep copy of the config
                    (vllm_model_wrapper.py), so the fp8 that vLLM's Attention derives from kv_cache_scheme under
                    `auto` does not reach the runner: the layers would hand e4m3 keys to a bf16 cache, which the
                    ragged paged attention kernel's static_validate_inputs refuses (`kv_cache.dtype == k.dtype`).
    kv.quantize     the impl's own step before the kernel, quantize_kv(kv_cache_quantized_dtype, k, v,
                    layer._k_scale_float, layer._v_scale_float), run on CPU with keys / values whose max|x| is the
                    calibrated one: the cached codes are clip(x / folder scale) in e4m3, the largest lands on 448,
                    and code x scale is x within half an e4m3 spacing.
  JAX-native path   (auto for Llama / Qwen3): the nnx attention modules hold `_k_scale = 1.0` / `_v_scale = 1.0`
                    (models/jax/llama3.py, qwen3.py, qwen2.py) and nothing assigns them from the checkpoint; with an
                    fp8 cache they quantize with 1.0, so the folder's scales are not used (FAIL-WRONG); with a bf16
                    cache nothing is quantized (INFO).

Negative controls: `--sabotage process` (vLLM's CompressedTensorsKVCacheMethod.process_weights_after_loading
followed by a reset of the scales to 1.0) and a folder whose kv_cache_scheme is removed must not pass;
`--kv-cache-dtype auto` shows the cache-dtype split.

    .vllm-tpu-venv/bin/python bench/vllm_tpu_kv_cache.py OUT [--kv-cache-dtype fp8|auto|fp8_e4m3]
        [--impl auto,vllm] [--sabotage process] [--check ../shared/vllm-tpu/tpu_accept.py] 2>/dev/null

The first --impl is judged (default auto: what `vllm serve` does), later ones are INFO, as in tpu_accept.py.
Last line: `VERDICT OK|REFUSE|WRONG`; exit 1 unless OK.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import vllm_harness as harness
from vllm_kv_scales import E4M3_MAX, SCALE_NAMES, attention_layers, expected_param, record_kv_loaders, report

harness.leave_import_path()
LOADS: list[tuple[str | None, str, object]] = []  # (checkpoint name, Attention parameter, tensor received)


def _install(check, kv_cache_dtype: str, sabotage: str | None) -> None:
    """The engine config with --kv-cache-dtype; a recorder on each Attention scale's weight_loader."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    def make_config(out: str):
        return EngineArgs(model=out, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                          skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype).create_engine_config()

    check.make_config = make_config  # load_once and run_impl call it by name
    check.install_load_tracking()
    tracked = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        import torch

        if isinstance(model, torch.nn.Module):
            record_kv_loaders(model, lambda: check.TRACK["current"], LOADS)
        return tracked(self, model, model_config)

    load_weights._tpu_accept = True
    DefaultModelLoader.load_weights = load_weights
    if sabotage == "process":
        from vllm.model_executor.layers.attention.attention import set_default_quant_scales
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsKVCacheMethod,
        )

        plain = CompressedTensorsKVCacheMethod.process_weights_after_loading

        def process(self, layer):
            plain(self, layer)
            set_default_quant_scales(layer, register_buffer=False)

        CompressedTensorsKVCacheMethod.process_weights_after_loading = process


def _runner_cache_dtype(vc):
    """The dtype TPUModelRunner allocates the KV cache in (tpu_runner.py, as quoted in the docstring)."""
    from tpu_inference.utils import to_jax_dtype

    cache_dtype = vc.cache_config.cache_dtype
    if cache_dtype == "auto":
        cache_dtype = vc.model_config.dtype
    return to_jax_dtype(cache_dtype)


def _maxima(folder: str, kv_ck: dict) -> dict[str, tuple[float, float]]:
    """Per attention block (`model.layers.N.self_attn`): the calibrated max|k|, max|v| (qconvert.json, else
    scale x 448)."""
    record = {}
    path = Path(folder) / "qconvert.json"
    if path.is_file():
        record = (json.loads(path.read_text()).get("kv_cache") or {}).get("absmax") or {}
    out = {}
    for name in kv_ck:
        attn = name.rsplit(".", 1)[0]
        if attn in out:
            continue
        if attn in record:
            out[attn] = (float(record[attn]["keys"]), float(record[attn]["values"]))
        elif f"{attn}.k_scale" in kv_ck and f"{attn}.v_scale" in kv_ck:
            out[attn] = tuple(float(kv_ck[f"{attn}.{s}"].reshape(-1)[0]) * E4M3_MAX for s in SCALE_NAMES)
    return out


def vllm_path(check, tag: str, vc, model, mi, ck, kv_ck: dict, qc: dict, fail_r: str, fail_w: str) -> None:
    import jax.numpy as jnp
    import numpy as np
    import torch
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    emit = check.emit
    layers = attention_layers(model)
    folder_scheme = qc.get("kv_cache_scheme")
    qcfg = vc.quant_config
    held = getattr(qcfg, "kv_cache_scheme", None)
    if folder_scheme is None:
        emit(fail_w, f"{tag}.kv.scheme", "config.json has no kv_cache_scheme: nothing tells vLLM TPU the scales are "
             "there; under --kv-cache-dtype auto the cache stays bf16 and the scales unused")
    elif held != folder_scheme:
        emit(fail_w, f"{tag}.kv.scheme",
             f"{type(qcfg).__name__}.kv_cache_scheme = {held} != the folder's {folder_scheme}")
    else:
        emit("OK", f"{tag}.kv.scheme", f"{type(qcfg).__name__}.kv_cache_scheme = the folder's (strategy "
             f"{held.get('strategy')}, {held.get('num_bits')}-bit {held.get('type')})")

    no_method = [n for n, m in layers.items() if not isinstance(getattr(m, "quant_method", None), BaseKVCacheMethod)]
    if not layers or no_method:
        emit(fail_w, f"{tag}.kv.method", f"{len(no_method)}/{len(layers)} Attention layer(s) without a KV-cache "
             f"method: {no_method[:3]}")
    else:
        emit("OK", f"{tag}.kv.method", f"{len(layers)} Attention layers, quant_method "
             f"{sorted({type(m.quant_method).__name__ for m in layers.values()})}, impl "
             f"{sorted({type(m.impl).__name__ for m in layers.values()})}")

    # consumed: the recorder saw each checkpoint scale reach its parameter, unchanged
    bad = []
    for name, tensor in kv_ck.items():
        got = [(p, t) for c, p, t in LOADS if c == name]
        if not got:
            bad.append(f"{name}: reached no Attention scale weight_loader")
        for pname, loaded in got:
            if pname != expected_param(name):
                bad.append(f"{name}: loaded into {pname}")
            elif loaded.dtype != tensor.dtype or not torch.equal(loaded.reshape(-1), tensor.reshape(-1)):
                bad.append(f"{name}: the loader got {loaded.reshape(-1).tolist()}, not {tensor.reshape(-1).tolist()}")
    missing = sorted(f"{n}.{s}" for n in layers for s in SCALE_NAMES
                     if not any(expected_param(k) == f"{n}.{s}" for k in kv_ck))
    if missing:
        bad.append(f"{len(missing)} Attention scale(s) with no checkpoint tensor (left at 1.0): {missing[:3]}")
    if bad:
        emit(fail_w, f"{tag}.kv.consumed", f"{len(bad)} problem(s): " + "; ".join(bad[:4]))
    else:
        first = next(iter(kv_ck))
        emit("OK", f"{tag}.kv.consumed", f"all {len(kv_ck)} k_scale / v_scale tensors reached their Attention "
             f"parameter's weight_loader (e.g. {first} -> {expected_param(first)}), bit for bit")

    # loaded: the layer's host floats and the sharded JAX arrays
    state = {k: check.to_np(v) for k, v in mi.state.items()}
    bad, shown = [], None
    for name, mod in layers.items():
        attn = name.rsplit(".attn", 1)[0]
        for s in SCALE_NAMES:
            tensor = kv_ck.get(f"{attn}.{s}")
            if tensor is None:
                continue
            want = float(tensor.reshape(-1)[0])
            as_float = getattr(mod, f"_{s}_float", None)
            keys = [k for k in state if k.endswith(f"{name}._{s}")]
            arrays = [state[k].reshape(-1) for k in keys]
            if as_float != want:
                bad.append(f"{name}._{s}_float = {as_float!r}, the folder's {want!r}")
            if not keys:
                bad.append(f"no JAX array named *{name}._{s}")
            elif any(a.dtype != np.float32 or not np.array_equal(a, np.float32([want])) for a in arrays):
                bad.append(f"{keys[0]} = {arrays[0].tolist()} ({arrays[0].dtype}), the folder's {want!r}")
            elif shown is None:
                shown = f"{keys[0]} = {arrays[0].tolist()}, {name}._{s}_float = {as_float!r}"
            if hasattr(mod, s):
                bad.append(f"{name}.{s}: placeholder not discarded")
    report(emit, f"{tag}.kv.loaded", bad, "mismatch(es) after loading, processing and sharding", 4,
           f"{len(kv_ck)} scales: each Attention layer's _k_scale_float / _v_scale_float and the sharded _k_scale / "
           f"_v_scale arrays equal the folder's, bit for bit ({shown})", fail=fail_w)

    # cache dtype: the layers' quantization against the runner's cache
    runner = _runner_cache_dtype(vc)
    quantized = {n: m.impl.kv_cache_quantized_dtype for n, m in layers.items()}
    kinds = sorted({(m.kv_cache_dtype, str(quantized[n])) for n, m in layers.items()})
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if all(q is None for q in quantized.values()):
        emit(fail_w, f"{tag}.kv.cache_dtype", f"layers {kinds}, runner cache {runner}: no layer quantizes its keys, "
             "so the scales are loaded but unused")
    elif any(q != runner for q in quantized.values()):
        emit(fail_r, f"{tag}.kv.cache_dtype", f"layers quantize keys / values to {kinds} but TPUModelRunner allocates "
             f"the cache in {runner} (engine cache_config.cache_dtype {vc.cache_config.cache_dtype!r}; the layers were "
             "built from vllm_model_wrapper's deep copy of the config, where vLLM's Attention turned auto into fp8 for "
             "kv_cache_scheme): ragged_paged_attention's static_validate_inputs raises 'Expected kv_cache.dtype to be "
             "equal to k.dtype' at the first step; pass --kv-cache-dtype fp8")
    elif any(q != e4m3 for q in quantized.values()):
        emit(fail_w, f"{tag}.kv.cache_dtype", f"layers {kinds}, runner cache {runner}: not e4m3, the format the "
             "scales were calibrated for (max|x| / 448)")
    else:
        emit("OK", f"{tag}.kv.cache_dtype", f"layers {kinds} and the runner's cache ({runner}, engine cache_dtype "
             f"{vc.cache_config.cache_dtype!r}) agree: e4m3")

    # quantize: the impl's own step before the kernel, with the layer's floats
    from tpu_inference.layers.common.quantization import quantize_kv

    maxima = _maxima(ck_folder(ck), kv_ck)
    bad, n, worst = [], 0, 0.0
    rng = np.random.default_rng(0)
    for name, mod in layers.items():
        attn = name.rsplit(".attn", 1)[0]
        dtype = quantized[name]
        if attn not in maxima or dtype is None:
            continue
        xs = []
        for absmax in maxima[attn]:
            x = rng.uniform(-absmax, absmax, size=(8, mod.num_kv_heads, mod.head_size)).astype(np.float32)
            x[0, 0, 0] = absmax  # the calibrated maximum itself
            xs.append(jnp.asarray(x))
        kq, vq = quantize_kv(dtype, xs[0], xs[1], mod._k_scale_float, mod._v_scale_float)
        for s, x, q in (("k_scale", xs[0], kq), ("v_scale", xs[1], vq)):
            scale = np.float32(kv_ck[f"{attn}.{s}"].reshape(-1)[0])
            codes = np.asarray(q.astype(jnp.float32))
            want = np.asarray(jnp.clip(x / scale, -E4M3_MAX, E4M3_MAX).astype(e4m3).astype(jnp.float32))
            n += 1
            if q.dtype != dtype or not np.array_equal(codes, want):
                bad.append(f"{attn}.{s}: cached codes are not clip(x / folder scale) in {dtype}")
                continue
            xn = np.asarray(x)
            spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(xn / scale), 2.0 ** -6))) - 3)
            err = float((np.abs(codes - xn / scale) / spacing).max())
            worst = max(worst, err)
            if err > 0.5 + 1e-6 or np.abs(codes).max() != E4M3_MAX:
                bad.append(f"{attn}.{s}: |code - x / scale| = {err:.3f} e4m3 spacings, "
                           f"max |code| {np.abs(codes).max()}")
    if bad:
        emit(fail_w, f"{tag}.kv.quantize", f"{len(bad)} problem(s): " + "; ".join(bad[:4]))
    elif n:
        emit("OK", f"{tag}.kv.quantize", f"{n} quantize_kv calls with the layers' _k_scale_float / _v_scale_float on "
             f"keys / values up to the calibrated max|x|: codes = clip(x / folder scale) in e4m3, bit for bit, the "
             f"maximum lands on 448, worst {worst:.3f} e4m3 spacings (round to nearest 0.5)")


def ck_folder(ck) -> str:
    return os.path.dirname(next(iter(ck.where.values())))


def jax_path(check, tag: str, vc, mi, kv_ck: dict, fail_w: str) -> None:
    """The flax_nnx models: what their attention modules hold for the scales."""
    from flax import nnx

    emit = check.emit
    # the attention modules set `_k_scale` in __init__ (in vars(); some nnx modules answer any attribute)
    holders = [(".".join(map(str, path)), node) for path, node in nnx.iter_graph(mi.model)
               if "_k_scale" in getattr(node, "__dict__", {}) and "kv_cache_quantized_dtype" in node.__dict__]
    if not holders:
        emit(fail_w, f"{tag}.kv.jax", "no attention module with _k_scale found in the nnx model")
        return
    values = sorted({(repr(getattr(m, "_k_scale")), repr(getattr(m, "_v_scale"))) for _, m in holders})
    dtypes = sorted({str(m.kv_cache_quantized_dtype) for _, m in holders})
    matches = all(f"{p}.{s}" in kv_ck and float(kv_ck[f"{p}.{s}"].reshape(-1)[0]) == getattr(m, f"_{s}")
                  for p, m in holders for s in SCALE_NAMES)
    where_ = f"{len(holders)} attention modules ({type(holders[0][1]).__module__}.{type(holders[0][1]).__name__})"
    if matches:
        emit("OK", f"{tag}.kv.jax", f"{where_} hold the folder's scales")
    elif all(d == "None" for d in dtypes):
        emit("INFO", f"{tag}.kv.jax", f"{where_}: cache not quantized (kv_cache_quantized_dtype None, engine "
             f"cache_dtype {vc.cache_config.cache_dtype!r}); their (_k_scale, _v_scale) are {values}, not the folder's")
    else:
        emit(fail_w, f"{tag}.kv.jax", f"{where_} quantize the cache to {dtypes} with (_k_scale, _v_scale) {values}: "
             "the constants set in __init__ (`self._k_scale = 1.0`), not the folder's scales (nothing in "
             "tpu-inference's JAX models or loaders assigns them from the checkpoint)")


def run(check, out: str, impls: list[str], kv_cache_dtype: str) -> int:
    import jax

    emit = check.emit
    cfg = json.loads((Path(out) / "config.json").read_text())
    qc = cfg.get("quantization_config") or {}
    ck = check.Checkpoint(out)
    kv_ck = {k: ck.get(k) for k in sorted(ck.meta) if k.rsplit(".", 1)[-1] in SCALE_NAMES}
    import importlib.metadata as md

    emit("INFO", "versions", ", ".join(f"{p} {md.version(p)}" for p in ("vllm-tpu", "tpu-inference", "jax", "torch"))
         + f"; devices {jax.devices()}")
    emit("INFO", "checkpoint", f"{os.path.basename(out)}: arch={cfg.get('architectures')} "
         f"kv_cache_scheme={'present' if qc.get('kv_cache_scheme') else 'absent'}; {len(kv_ck)} KV scale tensors "
         f"({sorted({str(list(ck.meta[k][0])) + ':' + ck.meta[k][1] for k in kv_ck})})")
    if not kv_ck:  # judged a failure; the paths are still loaded to show what they hold without scales
        emit("FAIL-WRONG", "kv.checkpoint", "the folder holds no k_scale / v_scale tensor")
    try:
        vc = check.make_config(out)
    except Exception as e:
        emit("FAIL-REFUSE", "config", f"{check.short_exc(e)} at {check.where(e)}")
        return check.finish()
    emit("INFO", "engine", f"--kv-cache-dtype {kv_cache_dtype}: engine cache_config.cache_dtype "
         f"{vc.cache_config.cache_dtype!r} -> TPUModelRunner's cache dtype {_runner_cache_dtype(vc)}")
    for i, impl in enumerate(impls):
        judge = i == 0
        fail_r, fail_w = ("FAIL-REFUSE", "FAIL-WRONG") if judge else ("INFO", "INFO")
        tag = f"impl[{impl}]"
        LOADS.clear()
        check.TRACK["model"] = None
        try:
            vc, resolved, mi = check.load_once(out, impl, -3)
        except Exception as e:
            emit(fail_r, f"{tag}.get_model", f"{check.short_exc(e)} at {check.where(e)}")
            continue
        if isinstance(mi.state, dict) and check.TRACK["model"] is not None:
            emit("OK" if judge else "INFO", f"{tag}.get_model", f"resolved to {resolved}: loaded (parameters "
                 "pre-filled with -3), processed and sharded on the CPU mesh")
            try:
                vllm_path(check, tag, vc, check.TRACK["model"], mi, ck, kv_ck, qc, fail_r, fail_w)
            except Exception as e:
                emit(fail_w, f"{tag}.kv.unexpected", f"{check.short_exc(e)} at {check.where(e)}")
        else:
            emit("OK" if judge else "INFO", f"{tag}.get_model", f"resolved to {resolved}: loaded")
            try:
                jax_path(check, tag, vc, mi, kv_ck, fail_w)
            except Exception as e:
                emit(fail_w, f"{tag}.kv.unexpected", f"{check.short_exc(e)} at {check.where(e)}")
    return check.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "fp8_e4m3", "auto"),
                        help="vLLM's --kv-cache-dtype (default fp8: what vLLM TPU needs to use the scales)")
    parser.add_argument("--impl", default="auto,vllm",
                        help="MODEL_IMPL_TYPE values, comma-separated; the first is judged")
    parser.add_argument("--sabotage", choices=("process",),
                        help="negative control: vLLM's KV-scale processing followed by a reset to 1.0")
    harness.add_check_argument(parser, harness.TPU_ACCEPT)
    args = parser.parse_args()
    check, out, _ = harness.start_given_check("vllm_tpu_kv_cache", args, "vLLM TPU check", "tpu_accept")
    _install(check, args.kv_cache_dtype, args.sabotage)
    if args.sabotage:
        check.emit("INFO", "sabotage", f"negative control: {args.sabotage} (this run must end in VERDICT WRONG)")
    impls = [x.strip() for x in args.impl.split(",") if x.strip()]
    harness.exit_reporting(check, lambda: run(check, out, impls, args.kv_cache_dtype))


if __name__ == "__main__":
    main()
