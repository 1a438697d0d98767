"""Which servers load a folder, by scheme (and flags) and model family: one table, set from recorded runs.

Each cell is what a server's own loading code said of a qconvert folder (docs/BENCHMARKS.md, "Server
acceptance"): vLLM 0.33 (../shared/vllm/vllm_accept.py), vLLM TPU 0.32 on a plain `vllm serve` and with
`MODEL_IMPL_TYPE=vllm` (../shared/vllm-tpu/tpu_accept.py), and transformers + compressed-tensors or
bitsandbytes (the tests' logits comparisons). A family or scheme not in the table was not measured.
"""

from __future__ import annotations

from typing import Any

from qconvert.formats.layout_base import LayoutFlags

SERVERS = ("vLLM GPU", "vLLM TPU", "vLLM TPU MODEL_IMPL_TYPE=vllm", "transformers")
YES, NO, UNMEASURED = "yes", "no", "not measured"
_CELL = {"Y": YES, "N": NO, "?": UNMEASURED}

# (scheme key, family) -> one cell per server, in SERVERS order (Y yes, N no, ? not measured).
TABLE: dict[tuple[str, str], str] = {
    ("fp8", "llama"): "YNYY",  # TPU default: the JAX Llama loader has no e4m3 dtype
    ("fp8", "qwen3"): "YYYY",
    ("fp8", "gemma3"): "YYYY",
    ("fp8", "mixtral"): "YYYY",
    ("fp8", "qwen3_moe"): "YYYY",
    ("int8", "llama"): "YNNY",  # tpu-inference 0.32 has no weight-only int8 scheme
    ("int8", "qwen3"): "YNNY",
    ("int8", "gemma3"): "YNNY",
    ("int8", "mixtral"): "YNNY",
    ("int8", "qwen3_moe"): "YNNY",
    ("w8a8", "llama"): "YNYY",
    ("w8a8", "qwen3"): "YNYY",
    ("w8a8", "gemma3"): "YYYY",
    ("w8a8", "mixtral"): "YNNN",  # TPU: no int8 fused-MoE scheme; transformers: cannot fuse int8 experts
    ("w8a8", "qwen3_moe"): "YNNN",
    ("int8", "qwen2_moe"): "???Y",
    ("int4-g64", "mixtral"): "???Y",
    ("int4-channel", "qwen2_moe"): "???Y",
    ("int4-channel", "qwen3_moe"): "???Y",  # the tests' Qwen3-MoE: widths no group divides
    ("int4-g64", "qwen3_moe"): "???Y",
    ("fp8", "qwen2_moe"): "???Y",
    ("w8a8", "qwen2_moe"): "???N",
    ("w8a8-static", "llama"): "YNNY",
    ("w8a8-static", "mixtral"): "NNN?",
    ("w8a8-static", "qwen3_moe"): "NNN?",
    ("int4", "llama"): "YNNY",  # tpu-inference 0.32 has no WNA16 scheme on its torchax path
    ("int4", "qwen3"): "YNNY",  # group 128: refused on TPUs with a 128-wide MXU (v5e and earlier)
    ("int4-g64", "qwen3"): "YYNY",
    ("int4", "gemma3"): "YNNY",
    ("int4", "phi3"): "Y??Y",
    ("int4", "mixtral"): "YNNY",
    ("int4", "qwen3_moe"): "YNNY",
    # DeepSeek-V3, vLLM TPU: tpu-inference 0.32 refuses every MLA model at config time unless NEW_MODEL_DESIGN=1
    # and DP attention (--additional_config) are set, which a plain `vllm serve` does not (not measured with them).
    ("int8", "deepseek_v3"): "YNNY",
    ("int4", "deepseek_v3"): "YNNY",
    ("int4-channel", "deepseek_v3"): "YNNY",  # vLLM: hidden a multiple of 128 (its Marlin MoE), as released
    ("fp8", "deepseek_v3"): "YNNY",
    ("w8a8", "deepseek_v3"): "YNNN",  # transformers: cannot fuse int8 experts
    ("nf4", "llama"): "N??Y",  # vLLM 0.33 removed bitsandbytes
    ("nf4", "qwen3"): "N??Y",
    # Gemma 3 multimodal: vLLM 0.33's Gemma 3 multimodal class imports torchvision, which its CPU check lacks.
    ("int4", "gemma3_mm"): "???Y",
    ("w8a8", "gemma3_mm"): "???Y",
    ("nf4", "gemma3_mm"): "N??Y",
    # W4A8-FP8: vLLM on a simulated H100 (bench/vllm_w4a8.py; vLLM 0.33 matches the scheme on compute capability
    # 9.0 only), vLLM TPU by bench/vllm_tpu_w4a8.py (tpu-inference requantizes MoE experts per channel).
    ("w4a8-fp8", "llama"): "YNYY",  # TPU default: the JAX Llama loader has no compressed-tensors weights
    ("w4a8-fp8", "qwen3"): "YNYY",  # TPU default: the JAX Qwen3 path has no W4A8 scheme
    ("w4a8-fp8", "gemma3"): "???Y",
    ("w4a8-fp8", "mixtral"): "YYYY",
    ("w4a8-fp8", "qwen3_moe"): "YYYY",
    # Zero points: vLLM by bench/vllm_zero_points.py (vllm_accept.py reading weight_zero_point); transformers 5.24
    # with CompressedTensorsConfig(dequantize=True), which decompresses fused experts without their zero points;
    # vLLM TPU 0.32 refuses it (Llama's JAX loader has no weight_packed path; its torchax path, Qwen3-MoE's on both,
    # finds no compressed-tensors scheme for it).
    ("int4-asym", "llama"): "YNNY",
    ("int4-asym", "qwen3"): "???Y",
    ("int4-asym", "gemma3"): "???Y",
    ("int4-asym", "mixtral"): "???N",
    ("int4-asym-channel", "qwen3_moe"): "YNNN",
    # BERT (the bundled example, all-MiniLM-L6-v2): transformers by tests/schemes/test_servers_bert.py, which runs each
    # folder's own model card snippet. vLLM's check (vllm_accept.py) maps only decoder tensor names, so vLLM's and
    # vLLM TPU's answers for encoders are not measured.
    ("int8", "bert"): "???Y",
    ("int4", "bert"): "???Y",
    ("w8a8", "bert"): "???Y",
    ("w8a8-static", "bert"): "???Y",
    ("fp8", "bert"): "???Y",
    ("nf4", "bert"): "N??Y",
    ("int4-asym", "bert"): "???Y",
    ("w4a8-fp8", "bert"): "???Y",
    # FP4: transformers 5.24 + compressed-tensors by tests/schemes/test_fp4.py (logits against the dequantized
    # folder, in bf16); vLLM's CPU check stops at its FP4 kernel choice (not measured); vLLM TPU by tpu_accept.py:
    # the JAX path (a plain `vllm serve`) has no FP4 compressed-tensors scheme; on the torchax path NVFP4A16 loads
    # (every tensor consumed, every array written) but its values are not judged (the check has no map of
    # tpu-inference's FP4 arrays), and MXFP4A16 is refused (its scheme match reads input activations' num_bits).
    # vLLM by bench/vllm_fp4.py (vllm_accept.py with the FP4 kernel choice a CPU lacks answered by a stub): read
    # bit for bit, dense and MoE, q/k/v and gate/up sharing one global scale as vLLM applies one per fused layer.
    # NVFP4A16 Qwen3-MoE: the experts read bit for bit, but vLLM's NVFP4 MoE method registers
    # w13/w2_input_global_scale whatever the config, which a weight-only checkpoint has none of (llm-compressor's
    # neither): they keep uninitialised memory and the check says WRONG (params.all_written). In vLLM 0.33's code the
    # weight-only method (use_a16) selects a backend that takes no activation key (Marlin), whose kernel format
    # drops the activation scales (convert_to_nvfp4_moe_kernel_format: a13_scale = None), so they are never read;
    # not run on a GPU, so the cell stays not measured.
    # NVFP4 (W4A4, --scheme nvfp4): vLLM by bench/vllm_fp4.py, the weights bit for bit as nvfp4a16's and one input
    # global scale per fused layer and per expert's gate/up pair. vLLM TPU 0.32 by tpu_accept.py: the JAX path
    # refuses it (Llama: input_global_scale is no param path of its loader; Qwen3: no JAX scheme for the layer);
    # on the torchax path the dense layers load (VllmCompressedTensorsW4A4Fp4: every tensor consumed, every array
    # written) but their values are not judged (the check has no map of tpu-inference's transposed FP4 arrays); in
    # its code the weights become [in, out] E2M1 with the E4M3 scale over the largest weight global scale, and
    # apply_weights hands sharded_quantized_matmul the float activations to quantize its own way (its warning: FP4 x
    # FP4 falls back to FP8 x FP8), the calibrated input_global_scale stored as input_scale and not read. The MoE
    # method has no w2_input_global_scale parameter (refused). transformers 5.24 + compressed-tensors
    # loads it and rounds the activations in the model's bf16 (its fake quantization), not as vLLM's float32
    # rounding does: not judged.
    ("nvfp4a16", "llama"): "YN?Y",
    ("nvfp4a16", "qwen3"): "YN?Y",
    ("mxfp4a16", "llama"): "YNNY",
    ("mxfp4a16", "qwen3"): "YNNY",
    ("nvfp4a16", "qwen3_moe"): "???N",  # transformers decompresses fused NVFP4 experts without their global scale
    ("mxfp4a16", "qwen3_moe"): "Y??Y",
    ("nvfp4a16", "bert"): "???Y",
    ("nvfp4", "llama"): "YN??",
    ("nvfp4", "qwen3"): "YN??",
    ("nvfp4", "qwen3_moe"): "YNN?",
    ("mxfp4a16", "bert"): "???Y",
    ("nvfp4", "bert"): "???Y",  # its card's snippet: transformers' bf16 rounding of the activations, pooled cosine
    # gpt-oss: its attention projections quantized, its fused experts float in every scheme (vLLM 0.33's fp8 and
    # NVFP4 MoE methods hold no expert bias, its int4 one reads gpt-oss experts only under vLLM's own parameter names,
    # and transformers 5.24 merges no per-expert tensors into GptOssExperts: qconvert/models/gpt_oss.py). vLLM by
    # bench/vllm_gpt_oss.py (vllm_accept.py answering under gpt-oss's name mapper and counting the experts vLLM
    # copies directly; the experts compared exactly, a gate/up swap caught); transformers by
    # tests/models/test_gpt_oss*.py (logits against the folder's own values and the float model).
    ("int4", "gpt_oss"): "Y??Y",
    ("int8", "gpt_oss"): "Y??Y",
    ("fp8", "gpt_oss"): "Y??Y",
    ("nvfp4a16", "gpt_oss"): "Y??Y",
    ("mxfp4a16", "gpt_oss"): "Y??Y",
    ("w8a8", "gpt_oss"): "Y???",
    ("nvfp4", "gpt_oss"): "Y???",
}


# The docs' names: each server at the version measured, each family as its makers write it.
TITLES = {"vLLM GPU": "vLLM 0.33 (GPU)", "vLLM TPU": "vLLM TPU 0.32", "vLLM TPU MODEL_IMPL_TYPE=vllm":
          "vLLM TPU 0.32, `MODEL_IMPL_TYPE=vllm`", "transformers": "transformers 5.24"}
FAMILIES = {"llama": "Llama", "qwen3": "Qwen3", "gemma3": "Gemma 3", "phi3": "Phi-3", "mixtral": "Mixtral",
            "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3",
            "gemma3_mm": "Gemma 3 multimodal", "gpt_oss": "gpt-oss", "bert": "BERT"}

# Each scheme's layout, in the words its loaders use (docs/FORMATS.md has it tensor by tensor).
LAYOUTS = {
    "int8": "compressed-tensors `pack-quantized`, 8 bits",
    "int4": "compressed-tensors `pack-quantized`, 4 bits",
    "w8a8": "compressed-tensors `int-quantized`",
    "fp8": "compressed-tensors `float-quantized`",
    "nf4": "bitsandbytes 4-bit",
    "int4-asym": "compressed-tensors `pack-quantized`, 4 bits, with `weight_zero_point`",
    "w4a8-fp8": "compressed-tensors `pack-quantized`, 4 bits, FP8 `input_activations`",
    "nvfp4a16": "compressed-tensors `nvfp4-pack-quantized`",
    "mxfp4a16": "compressed-tensors `mxfp4-pack-quantized`",
    "nvfp4": "compressed-tensors `nvfp4-pack-quantized` with NVFP4 `input_activations` and `input_global_scale`",
}

# What a server's verdict on a scheme holds under, or why it says no, where the cells alone would not tell (a
# sentence: the docs' tables write it after the verdicts).
NOTES = {
    ("int4", "vLLM GPU"): "Machete / Marlin on Hopper",
    ("nf4", "vLLM GPU"): "vLLM 0.33 removed bitsandbytes",
    ("int4-asym", "vLLM GPU"): "Machete / Marlin with zero points (bench/vllm_zero_points.py)",
    ("w4a8-fp8", "vLLM GPU"): ("Hopper only: group 128, input widths multiples of 128, experts' 256; `quantize` says so "
                               "in one line otherwise"),
    ("nvfp4a16", "vLLM GPU"): ("Read bit for bit with the GPU kernel choice stubbed on a CPU (bench/vllm_fp4.py), "
                               "--gptq's folders too (q/k/v and gate/up share one global scale a fused layer)"),
    ("nvfp4", "vLLM GPU"): ("CompressedTensorsW4A4Fp4 and its NVFP4 MoE method (Blackwell kernels): read bit for bit "
                            "with the GPU kernel choice stubbed on a CPU (bench/vllm_fp4.py), one input global scale "
                            "per fused layer"),
    ("nvfp4", "vLLM TPU"): "Its JAX path has no NVFP4 W4A4 compressed-tensors scheme",
    ("nvfp4", "vLLM TPU MODEL_IMPL_TYPE=vllm"): ("Dense layers load (values not judged): tpu-inference keeps the FP4 "
                                                 "weights and quantizes the activations in its own matmul (FP8 where "
                                                 "the TPU has no FP4 x FP4), the input_global_scale loaded and unused; "
                                                 "its MoE method has no input_global_scale parameter"),
    ("mxfp4a16", "vLLM GPU"): "Read bit for bit with the GPU kernel choice stubbed on a CPU (bench/vllm_fp4.py)",
    ("int8", "vLLM TPU"): "No weight-only int8 scheme",
    ("nvfp4a16", "vLLM TPU"): "Its JAX path has no FP4 compressed-tensors scheme",
    ("mxfp4a16", "vLLM TPU"): "Its JAX path has no FP4 compressed-tensors scheme",
    ("mxfp4a16", "vLLM TPU MODEL_IMPL_TYPE=vllm"): "Its scheme match reads input activations a weight-only config lacks",
    ("int4", "vLLM TPU"): "No WNA16 scheme on its torchax path",
    ("fp8", "vLLM TPU"): "Llama: its JAX loader has no e4m3 dtype",
    ("w4a8-fp8", "vLLM TPU"): "tpu-inference requantizes the experts per channel",
    ("int8", "transformers"): "Decompressed to float",
    ("int4", "transformers"): "Decompressed to float",
    ("w8a8", "transformers"): "It cannot fuse int8 experts",
    ("fp8", "transformers"): "Activations rounded to FP8 per token",
    ("nf4", "transformers"): ("A model with experts is refused, exit 2: bitsandbytes keeps experts float; "
                              "`--exclude '*.experts.*'` gives a folder it loads"),
    ("int4-asym", "transformers"): "With `CompressedTensorsConfig(dequantize=True)`; fused experts lose their zero points",
    ("w4a8-fp8", "transformers"): "Weights decompressed to float; activations not rounded",
    ("nvfp4a16", "transformers"): ("Loaded with dtype=torch.bfloat16 (compressed-tensors decompresses FP4 to bf16); "
                                   "fused experts come out without their global scale, wrong"),
    ("mxfp4a16", "transformers"): "Loaded with dtype=torch.bfloat16 (compressed-tensors decompresses FP4 to bf16)",
}


def scheme_key(scheme: str, flags: LayoutFlags) -> str:
    """The table's key of a scheme with the flags that change where it loads: every group size its own, one
    scale per output channel (`-channel`) too, never folded into the default's (group 128) key."""
    from qconvert.schemes import scheme_named

    if flags.static_act:
        return f"{scheme}-static"
    if scheme_named(scheme).takes_group_size:
        if flags.group_size is None:
            return f"{scheme}-channel"
        if flags.group_size != 128:
            return f"{scheme}-g{flags.group_size}"
    return scheme


def family_of(config: dict[str, Any]) -> str:
    """The table's family of a config.json (its model_type; Gemma 3's text model as gemma3; a multimodal
    checkpoint, which the servers load through another class, apart: gemma3_mm)."""
    model_type = str(config.get("model_type", ""))
    if isinstance(config.get("vision_config"), dict):
        return f"{model_type}_mm"
    return model_type.removesuffix("_text")


# Families vLLM TPU 0.32 serves by default through its own JAX models, whose attention keeps scale 1.0 and whose
# loaders take no KV-cache scale (Qwen3: refused at load; measured by bench/vllm_tpu_kv_cache.py,
# docs/BENCHMARKS.md "KV-cache FP8 scales"). Other families fall back to its vLLM path, which reads them.
JAX_NATIVE_ON_TPU = ("llama", "qwen3")


def servers(key: str, family: str, kv_cache: bool = False) -> dict[str, str]:
    """Each server's recorded answer for scheme key `key` on `family` (yes, no or not measured); with
    `kv_cache` (the folder has KV-cache scales), vLLM TPU's default path answers no for its JAX-native families."""
    cells = TABLE.get((key, family), "?" * len(SERVERS))
    if kv_cache and family in JAX_NATIVE_ON_TPU:
        cells = cells[0] + "N" + cells[2:]
    return {server: _CELL[cell] for server, cell in zip(SERVERS, cells)}


def scheme_cell(scheme: str, server: str) -> str:
    """What the table records for `scheme` on `server` (a docs table's cell): yes or no where every family measured
    agrees, else which families say which; then each flag that changes it, with its families (`with
    `--group-size 64`: yes (Qwen3)`); NOTES' condition last."""
    column = SERVERS.index(server)
    variants = dict.fromkeys(key for key, _ in TABLE if _split_key(key)[0] == scheme and key != scheme)
    parts = [_verdict(scheme, column, name_families=False)]
    parts += [f"with `{flags_of(key)[1]}`: {_verdict(key, column)}" for key in variants if _verdict(key, column)]
    text = "; ".join(filter(None, parts)) or UNMEASURED
    note = NOTES.get((scheme, server))
    return f"{text}. {note}" if note else text


def _verdict(key: str, column: int, name_families: bool = True) -> str:
    """What the families measured for `key` in `column` say: yes (Llama, Qwen3), no (Mixtral); '' when none was
    measured. Without `name_families`, a bare yes or no where all agree."""
    said: dict[str, list[str]] = {YES: [], NO: []}
    for family in FAMILIES:
        cell = _CELL[TABLE.get((key, family), "?" * len(SERVERS))[column]]
        if cell != UNMEASURED:
            said[cell].append(FAMILIES[family])
    if not name_families and not (said[YES] and said[NO]):
        return YES if said[YES] else NO if said[NO] else ""
    return ", ".join(f"{answer} ({', '.join(names)})" for answer, names in said.items() if names)


def kv_cache_note(family: str) -> str:
    """One line for a folder with KV-cache scales whose family vLLM TPU serves by default through its JAX model,
    which does not read them."""
    if family not in JAX_NATIVE_ON_TPU:
        return ""
    return (f"vLLM TPU 0.32 reads KV-cache scales for {family} only with MODEL_IMPL_TYPE=vllm and "
            "--kv-cache-dtype fp8; its default JAX model does not")


def tpu_note(key: str, family: str) -> str:
    """One line when vLLM TPU is recorded refusing `key` on `family` on both paths: what it takes instead."""
    cells = servers(key, family)
    if cells[SERVERS[1]] != NO or cells[SERVERS[2]] != NO:
        return ""
    takes = []
    for (other, other_family), row in TABLE.items():
        if other_family != family or other == key:
            continue
        if row[1] == "Y":
            takes.append(_as_flags(other, key))
        elif row[2] == "Y":
            takes.append(f"{_as_flags(other, key)} (MODEL_IMPL_TYPE=vllm)")
    instead = f"it loads {', '.join(takes)}" if takes else "no scheme was recorded loading there"
    return f"vLLM TPU 0.32 does not load --scheme {_as_flags(key)} for {family}; {instead}"


def flags_of(key: str) -> tuple[str, str]:
    """(scheme, the flags that give the table key `key`): ("int4", "--group-size 64"); ("int8", "")."""
    scheme = _split_key(key)[0]
    return scheme, _as_flags(key).removeprefix(scheme).strip()


def _split_key(key: str) -> tuple[str, str]:
    """(scheme, variant) of a table key: the variant is its last part when that is one (static, channel, gNN), so
    a scheme named with a hyphen (int4-asym) stays whole."""
    scheme, _, variant = key.rpartition("-")
    if scheme and (variant in ("static", "channel") or (variant[:1] == "g" and variant[1:].isdigit())):
        return scheme, variant
    return key, ""


def _as_flags(key: str, chosen: str | None = None) -> str:
    """A table key as the flags that give it; beside the `chosen` key of the same scheme, the flag that differs
    is spelled out (`w8a8 --act dynamic` next to a chosen `w8a8 --act static`, never a bare `w8a8`)."""
    scheme, variant = _split_key(key)
    same_scheme = chosen is not None and _split_key(chosen)[0] == scheme and chosen != key
    if variant == "static":
        return f"{scheme} --act static"
    if variant == "channel":
        return f"{scheme} --group-size channel"
    if variant:
        return f"{scheme} --group-size {variant[1:]}"
    if same_scheme:
        chosen_variant = _split_key(chosen)[1]
        return f"{scheme} --act dynamic" if chosen_variant == "static" else f"{scheme} --group-size 128"
    return scheme
