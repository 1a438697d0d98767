"""vLLM's own loading of a folder's FP8 KV-cache scales (`--kv-cache fp8`): parsed, consumed, kept and used.

../shared/vllm/vllm_accept.py runs vLLM 0.33's own code on CPU (config parsing, the model class built under the
quantization config, DefaultModelLoader.load_weights twice with the parameters pre-filled with 7 and with -3, every
parameter against the tensors it comes from, the dequantization against compressed-tensors'). It exempts the
attention layers' q/k/v scale parameters from its checks (placeholders of CompressedTensorsKVCacheMethod). This
script runs that same check and adds, for a folder with `k_scale` / `v_scale` tensors:

  kv.scheme        vLLM's CompressedTensorsConfig holds the folder's `kv_cache_scheme` (validated by
                   CompressedTensorsKVCacheMethod.validate_kv_cache_scheme: 8-bit float, tensor or attn_head,
                   symmetric).
  kv.method        every Attention layer's quant_method is CompressedTensorsKVCacheMethod (a BaseKVCacheMethod):
                   it is what creates the k_scale / v_scale parameters a checkpoint can load into.
  kv.cache_dtype   each Attention layer's kv_cache_dtype is fp8 (E4M3): with `--kv-cache-dtype auto` (vllm serve's
                   default) vLLM turns auto into fp8 because the config declares a kv_cache_scheme
                   (layers/attention/attention.py); `--kv-cache-dtype fp8` sets it explicitly.
  kv.remap         vLLM's own cache-scale mapper (QuantizationConfig.get_cache_scale_mapper, applied by
                   AutoWeightsLoader) names `<attn>.self_attn.k_scale` `<attn>.self_attn.attn.k_scale`.
  kv.consumed      every checkpoint k_scale / v_scale reached the weight_loader of that Attention parameter, in both
                   loads, with the checkpoint's value, bit for bit; every Attention layer got both of its scales
                   (CompressedTensorsKVCacheMethod initialises them to 1.0, so a missing one would pass silently).
  kv.values        after loading, each layer's k_scale / v_scale parameter equals the folder's tensor, bit for bit
                   (the pre-fill with 7 / -3 would show through otherwise).
  kv.record        (qconvert.json's kv_cache record) each stored scale is float32(max|x|) / 448, the record's maxima.
  kv.after_process vLLM's process_weights_after_loading (model_loader/utils.py: the layer's quant method, then the
                   Attention layer's own) leaves `_k_scale` / `_v_scale` (the buffers FlashAttention and Triton read),
                   `_k_scale_float` / `_v_scale_float` (what FlashInfer and the CPU backend read) and the host copies
                   `_k_scale_cpu` / `_v_scale_cpu` equal to the folder's values, not 1.0.

Negative controls (each must end in VERDICT WRONG):

  --sabotage remap    vLLM's cache-scale mapper replaced by an empty one: the scales no longer reach .attn.k_scale;
  --sabotage process  CompressedTensorsKVCacheMethod.process_weights_after_loading followed by a reset of the scales
                      to 1.0 (what vLLM does for a layer without a KV-cache method);
  and a folder whose config.json has no kv_cache_scheme (the cache stays bf16 under `--kv-cache-dtype auto`).

Run it with the vLLM venv's python (it needs vllm, torch and compressed-tensors, not qconvert):

    VLLM_TARGET_DEVICE=cpu .vllm-venv/bin/python bench/vllm_kv_cache.py OUT [--kv-cache-dtype auto|fp8|fp8_e4m3]
        [--ref FLOAT_MODEL] [--no-h100] [--sabotage remap|process] [--check ../shared/vllm/vllm_accept.py]

The last line is vllm_accept.py's `VERDICT OK|REFUSE|WRONG`; exit 1 unless OK.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import vllm_harness as harness
from vllm_kv_scales import E4M3_MAX, SCALE_NAMES, attention_layers, expected_param, record_kv_loaders, report

harness.leave_import_path()


class State:
    def __init__(self) -> None:
        self.model = None
        self.vllm_config = None
        self.current: str | None = None  # the checkpoint tensor being loaded
        self.loads: list[tuple[str | None, str, object]] = []  # (checkpoint name, parameter, tensor)
        self.ck = None
        self.kv_ck: dict[str, object] = {}  # checkpoint KV scale name -> tensor
        self.initial: dict[str, object] = {}  # Attention parameters as create_weights made them
        self.requested = "auto"  # --kv-cache-dtype
        self.has_kv = False  # the folder holds k_scale / v_scale tensors
        self.loaded = False
        self.processed = False


def _install(check, state: State, kv_cache_dtype: str, sabotage: str | None) -> None:
    import vllm.model_executor.model_loader.utils as loader_utils
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    plain_init = loader_utils.initialize_model

    def initialize_model(*a, **kw):
        if kv_cache_dtype != "auto":
            # what --kv-cache-dtype sets (EngineArgs -> CacheConfig.cache_dtype), read by each Attention layer as it
            # is built
            kw["vllm_config"].cache_config.cache_dtype = kv_cache_dtype
        model = plain_init(*a, **kw)
        state.model, state.vllm_config = model, kw.get("vllm_config")
        state.initial = {f"{mn}.{pn}": p.detach().clone() for mn, mod in attention_layers(model).items()
                         for pn, p in mod.named_parameters(recurse=False)}
        record_kv_loaders(model, lambda: state.current, state.loads)
        return model

    loader_utils.initialize_model = initialize_model

    plain_get_all = DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        for name, tensor in plain_get_all(self, model_config, model):
            state.current = name
            yield name, tensor
        state.current = None

    DefaultModelLoader.get_all_weights = get_all_weights

    if sabotage == "remap":
        from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
        from vllm.model_executor.models.utils import WeightsMapper

        QuantizationConfig.get_cache_scale_mapper = staticmethod(lambda: WeightsMapper())
    elif sabotage == "process":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsKVCacheMethod,
        )

        plain_process = CompressedTensorsKVCacheMethod.process_weights_after_loading

        def process(self, layer):
            plain_process(self, layer)
            _reset_scales(layer)

        CompressedTensorsKVCacheMethod.process_weights_after_loading = process

    plain_dequant, plain_finish, plain_emit = check.dequant_check, check.finish, check.emit

    def dequant_check(model, ck, qc, packed_map, expert_names):
        plain_dequant(model, ck, qc, packed_map, expert_names)
        state.loaded, state.ck = True, ck
        try:
            _loaded_checks(check, state, qc)
        except Exception as e:  # a check that cannot run is a failure, not a pass
            check.emit("FAIL-WRONG", "kv.unexpected", f"{check.short_exc(e)} at {check.where(e)}")

    def finish():
        if state.loaded and not state.processed:
            state.processed = True
            try:
                _after_processing(check, state)
            except Exception as e:
                check.emit("FAIL-WRONG", "kv.after_process", f"{check.short_exc(e)} at {check.where(e)}")
        return plain_finish()

    def emit(status: str, name: str, detail: str = "") -> None:
        if name == "kv_cache_placeholders" and state.has_kv:
            detail = (f"{detail.split(' (')[0]} (exempt from the accept check's fill / value checks; their "
                      f"k_scale / v_scale are checked by kv.* below)")
        plain_emit(status, name, detail)

    check.dequant_check, check.finish, check.emit = dequant_check, finish, emit


def _reset_scales(layer) -> None:
    """The sabotage of --sabotage process: every scale back to 1.0 (vLLM's set_default_quant_scales)."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    set_default_quant_scales(layer, register_buffer=False)


def _loaded_checks(check, state: State, qc: dict) -> None:
    """The kv.* checks of the module docstring on the model as loaded (kv.after_process aside)."""
    emit, ck, model = check.emit, state.ck, state.model
    state.kv_ck = {k: ck.get(k) for k in sorted(ck.meta) if k.rsplit(".", 1)[-1] in SCALE_NAMES}
    if not state.kv_ck:
        emit("FAIL-WRONG", "kv.checkpoint", "the folder holds no k_scale / v_scale tensor")
        return
    shapes = sorted({f"{list(ck.meta[k][0])}:{ck.meta[k][1]}" for k in state.kv_ck})
    emit("INFO", "kv.checkpoint", f"{len(state.kv_ck)} KV-cache scale tensors ({', '.join(shapes)}), e.g. "
         f"{next(iter(state.kv_ck))} = {next(iter(state.kv_ck.values())).reshape(-1)[0].item()!r}")
    qcfg = state.vllm_config.quant_config
    _scheme_check(emit, qcfg, qc.get("kv_cache_scheme"))
    layers = attention_layers(model)
    _method_check(emit, layers)
    _cache_dtype_check(emit, state, layers)
    params = dict(model.named_parameters())
    _remap_check(emit, state, qcfg, params)
    _consumed_check(emit, state, layers)
    _values_check(emit, state, params)
    _record_check(emit, state, ck)


def _scheme_check(emit, qcfg, folder_scheme) -> None:
    """kv.scheme: vLLM's config holds the folder's kv_cache_scheme."""
    held = getattr(qcfg, "kv_cache_scheme", None)
    if folder_scheme is None:
        emit("FAIL-WRONG", "kv.scheme", "config.json's quantization_config has no kv_cache_scheme: under "
             "--kv-cache-dtype auto vLLM keeps the cache in the model dtype and the scales, though loaded, are "
             "unused (only an explicit --kv-cache-dtype fp8 would use them)")
    elif held != folder_scheme:
        emit("FAIL-WRONG", "kv.scheme",
             f"{type(qcfg).__name__}.kv_cache_scheme = {held} != the folder's {folder_scheme}")
    else:
        emit("OK", "kv.scheme", f"{type(qcfg).__name__}.kv_cache_scheme = the folder's "
             f"(num_bits {held.get('num_bits')}, type {held.get('type')}, strategy {held.get('strategy')}, "
             f"symmetric {held.get('symmetric')}, dynamic {held.get('dynamic')}); validate_kv_cache_scheme passed")


def _method_check(emit, layers: dict) -> None:
    """kv.method: every Attention layer has a KV-cache method."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsKVCacheMethod,
    )
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    methods = {type(getattr(m, "quant_method", None)).__name__ for m in layers.values()}
    no_method = [n for n, m in layers.items() if not isinstance(getattr(m, "quant_method", None), BaseKVCacheMethod)]
    if not layers or no_method:
        emit("FAIL-WRONG", "kv.method", f"{len(no_method)}/{len(layers)} Attention layer(s) without a KV-cache method "
             f"(their scales are never loaded): {no_method[:4]}")
    else:
        ct = all(isinstance(m.quant_method, CompressedTensorsKVCacheMethod) for m in layers.values())
        emit("OK", "kv.method", f"{len(layers)} Attention layers, quant_method {sorted(methods)}"
             f"{' (a BaseKVCacheMethod)' if ct else ''}: k_scale / v_scale parameters "
             f"{sorted({str(tuple(getattr(m, 'k_scale').shape)) for m in layers.values() if hasattr(m, 'k_scale')})}")


def _cache_dtype_check(emit, state: State, layers: dict) -> None:
    """kv.cache_dtype: each Attention layer's cache is fp8 (E4M3)."""
    # "fp8" and "fp8_e4m3" are E4M3 (the cache is allocated as bytes, STR_DTYPE_TO_TORCH_DTYPE -> uint8, and the
    # backends view it as current_platform.fp8_dtype(): float8_e4m3fn on CUDA and CPU, e4m3fnuz on MI300)
    from vllm.platforms import current_platform

    dtypes = {(m.kv_cache_dtype, str(m.kv_cache_torch_dtype).replace("torch.", "")) for m in layers.values()}
    not_fp8 = [n for n, m in layers.items() if m.kv_cache_dtype not in ("fp8", "fp8_e4m3")]
    requested = state.vllm_config.cache_config.cache_dtype
    became = "; --kv-cache-dtype auto became fp8 because the config declares a kv_cache_scheme"
    if not_fp8:
        emit("FAIL-WRONG", "kv.cache_dtype", f"{len(not_fp8)}/{len(layers)} Attention layer(s) keep a "
             f"{sorted(dtypes)} cache, not fp8 e4m3 (e.g. {not_fp8[0]}): the scales would not be used")
    else:
        emit("OK", "kv.cache_dtype", f"every Attention layer's kv_cache_dtype, storage: {sorted(dtypes)}, viewed as "
             f"{str(current_platform.fp8_dtype()).replace('torch.', '')} (cache_config.cache_dtype now {requested!r}"
             f"{became if state.requested == 'auto' else ''})")


def _remap_check(emit, state: State, qcfg, params: dict) -> None:
    """kv.remap: vLLM's own mapper on the checkpoint names."""
    mapper = qcfg.get_cache_scale_mapper()
    wrong_map = []
    for name in state.kv_ck:
        mapped, want = mapper._map_name(name), expected_param(name)
        if mapped != want or want not in params:
            wrong_map.append(f"{name} -> {mapped} (expected {want}{'' if want in params else ', not a parameter'})")
    first = next(iter(state.kv_ck))
    if wrong_map:
        emit("FAIL-WRONG", "kv.remap", f"{len(wrong_map)} name(s): " + "; ".join(wrong_map[:4]))
    else:
        emit("OK", "kv.remap", f"vLLM's get_cache_scale_mapper: {first} -> {mapper._map_name(first)} "
             f"(all {len(state.kv_ck)} onto Attention parameters)")


def _consumed_check(emit, state: State, layers: dict) -> None:
    """kv.consumed: both loads delivered each checkpoint scale to its parameter, unchanged."""
    import torch

    by_ck: dict[str, list[tuple[str, object]]] = {}
    for ck_name, pname, tensor in state.loads:
        by_ck.setdefault(ck_name, []).append((pname, tensor))
    bad = []
    for name, tensor in state.kv_ck.items():
        got = by_ck.get(name, [])
        if len(got) != 2:
            bad.append(f"{name}: reached a KV-scale weight_loader {len(got)} time(s) in 2 loads")
            continue
        for pname, loaded in got:
            if pname != expected_param(name):
                bad.append(f"{name}: loaded into {pname}")
            elif loaded.dtype != tensor.dtype or not torch.equal(loaded.reshape(-1), tensor.reshape(-1)):
                bad.append(f"{name}: the loader got {loaded.reshape(-1).tolist()} ({loaded.dtype}), "
                           "not the folder's value")
    stray = sorted({pname for ck_name, pname, _ in state.loads if ck_name not in state.kv_ck})
    if stray:
        bad.append(f"KV-scale parameters written from other tensors: {stray[:4]}")
    missing = sorted(f"{n}.{s}" for n in set(layers) for s in SCALE_NAMES
                     if not any(expected_param(k) == f"{n}.{s}" for k in state.kv_ck))
    if missing:
        bad.append(f"{len(missing)} Attention scale(s) with no checkpoint tensor (CompressedTensorsKVCacheMethod "
                   f"leaves them at 1.0): {missing[:4]}")
    report(emit, "kv.consumed", bad, "problem(s)", 5, f"all {len(state.kv_ck)} k_scale / v_scale tensors went "
            f"through their Attention parameter's weight_loader in both loads, bit for bit; all {len(layers)} layers "
            "have both")


def _values_check(emit, state: State, params: dict) -> None:
    """kv.values: the parameters after the second load (pre-filled with -3)."""
    import torch

    bad = []
    for name, tensor in state.kv_ck.items():
        pname = expected_param(name)
        if pname not in params:
            bad.append(f"{pname}: no such parameter")
            continue
        value = params[pname].detach()
        if value.numel() != tensor.numel() or value.dtype != torch.float32 \
                or not torch.equal(value.reshape(-1), tensor.float().reshape(-1)) or tensor.dtype != torch.float32:
            bad.append(f"{pname}: {value.reshape(-1).tolist()} ({value.dtype}) vs the folder's "
                       f"{tensor.reshape(-1).tolist()} ({tensor.dtype})")
    report(emit, "kv.values", bad, "mismatch(es)", 4, f"{len(state.kv_ck)} Attention k_scale / v_scale parameters "
            "(float32) equal the folder's tensors bit for bit after the loads pre-filled with 7 and -3")


def _record_check(emit, state: State, ck) -> None:
    """kv.record: the folder's scales are its recorded maxima / 448 (float32)."""
    import torch

    record_path = Path(ck.folder) / "qconvert.json"
    record = json.loads(record_path.read_text()).get("kv_cache") if record_path.is_file() else None
    if not (isinstance(record, dict) and isinstance(record.get("absmax"), dict)):
        return
    bad, n = [], 0
    for attn, maxima in record["absmax"].items():
        for scale, key in (("k_scale", "keys"), ("v_scale", "values")):
            want = torch.tensor(maxima[key], dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32)
            want = want if want > 0 else torch.tensor(1.0)
            got = state.kv_ck.get(f"{attn}.{scale}")
            n += 1
            if got is None or not torch.equal(got.float().reshape(-1), want.reshape(-1)):
                bad.append(f"{attn}.{scale}: {None if got is None else got.reshape(-1).tolist()} vs "
                           f"{maxima[key]!r} / 448 = {want.item()!r}")
    report(emit, "kv.record", bad, "mismatch(es) with qconvert.json's kv_cache record", 4,
            f"{n} scales = float32(qconvert.json's max|x|) / 448, bit for bit ({record.get('rule', '')})")


def _after_processing(check, state: State) -> None:
    """vLLM's process_weights_after_loading, then what each Attention layer holds for its kernels."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    emit, model, vc = check.emit, state.model, state.vllm_config
    layers = attention_layers(model)
    # The accept check pre-filled every parameter (7, then -3); the ones no checkpoint tensor wrote (q_scale and the
    # zero points: the folder has none) go back to what create_weights made, as in a real load.
    params = dict(model.named_parameters())
    restored = []
    with torch.no_grad():
        for pname, init in state.initial.items():
            if pname in params and pname.rsplit(".", 1)[1] not in SCALE_NAMES:
                params[pname].copy_(init)
                restored.append(pname.rsplit(".", 1)[1])
    if restored:
        emit("INFO", "kv.placeholders", f"{sorted(set(restored))} (not in the folder) reset from the accept check's "
             f"pre-fill to their create_weights values before processing")
    with set_current_vllm_config(vc):
        try:
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
            how = "vLLM's process_weights_after_loading (model_loader/utils.py) on the whole model"
        except Exception as e:
            # a CPU linear kernel may not process; the attention part is the two calls that function makes per layer
            emit("INFO", "kv.process_note", f"whole-model process_weights_after_loading raised "
                 f"{check.short_exc(e, 300)} at {check.where(e)}; running its two Attention steps per layer")
            for mod in layers.values():
                if hasattr(mod, "k_scale"):  # else its quant method ran before the raise
                    mod.quant_method.process_weights_after_loading(mod)
                # the function's second loop (each Attention layer's own step) comes after the one that raised
                mod.process_weights_after_loading(vc.model_config.dtype)
            how = "each Attention layer's quant_method.process_weights_after_loading, then its own"
    bad, q_scales = [], set()
    for name, mod in layers.items():
        for s in SCALE_NAMES:
            tensor = state.kv_ck.get(f"{name.rsplit('.attn', 1)[0]}.{s}")
            if tensor is None:
                bad.append(f"{name}.{s}: no checkpoint tensor")
                continue
            want = tensor.float().reshape(-1)
            as_float = getattr(mod, f"_{s}_float", None)
            buf = getattr(mod, f"_{s}").detach().reshape(-1)
            host = getattr(mod, f"_{s}_cpu").detach().reshape(-1)
            if as_float != want.item() or not torch.equal(buf.float(), want) or not torch.equal(host.float(), want):
                bad.append(f"{name}: _{s}_float {as_float!r}, _{s} {buf.tolist()}, _{s}_cpu {host.tolist()} vs the "
                           f"folder's {want.tolist()}")
            if hasattr(mod, s):
                bad.append(f"{name}.{s}: placeholder not discarded")
        q_scales.add(getattr(mod, "_q_scale_float", None))
    if bad:
        emit("FAIL-WRONG", "kv.after_process", f"{len(bad)} mismatch(es) after {how}: " + "; ".join(bad[:4]))
    else:
        sample = next(iter(layers.values()))
        emit("OK", "kv.after_process", f"after {how}: every layer's _k_scale_float / _v_scale_float, _k_scale / "
             f"_v_scale and the host copies equal the folder's scales bit for bit (e.g. {next(iter(layers))}: "
             f"k {sample._k_scale_float!r}, v {sample._v_scale_float!r}; cache {sample.kv_cache_dtype})")
    emit("INFO", "kv.q_scale", f"_q_scale_float {sorted(q_scales)}: the folder has no q_scale, vLLM keeps "
         "CompressedTensorsKVCacheMethod's placeholder (FlashAttention's query quantization, where used, scales by it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                        help="vLLM's --kv-cache-dtype (default auto, as vllm serve)")
    parser.add_argument("--ref", help="the float model the folder was made from (passed to the accept check)")
    parser.add_argument("--no-h100", action="store_true", help="skip the simulated sm90 kernel choice")
    parser.add_argument("--sabotage", choices=("remap", "process"),
                        help="negative control: break vLLM's KV-scale remap or its post-load processing")
    harness.add_check_argument(parser, harness.VLLM_ACCEPT)
    args = parser.parse_args()
    check, out, ref = harness.start_given_check("vllm_kv_cache", args, "vLLM check", "vllm_accept")
    state = State()
    state.requested = args.kv_cache_dtype
    from safetensors import safe_open

    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            state.has_kv |= any(k.rsplit(".", 1)[-1] in SCALE_NAMES for k in h.keys())
    _install(check, state, args.kv_cache_dtype, args.sabotage)
    if args.sabotage:
        check.emit("INFO", "sabotage", f"negative control: {args.sabotage} (this run must end in VERDICT WRONG)")
    check.emit("INFO", "kv.cache_dtype_requested", f"--kv-cache-dtype {args.kv_cache_dtype}")
    harness.run_check_main(check, args.check, out, ref, args.no_h100)


if __name__ == "__main__":
    main()
