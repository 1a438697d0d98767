"""Tiny gpt-oss checkpoints: a float one built and saved by transformers itself, and its MXFP4 form written as the
shipped gpt-oss checkpoints store their experts (`*_blocks` uint8 [experts, rows, groups, 16] and `*_scales`
uint8 E8M0 [experts, rows, groups], each expert's [in, out] tensor stored transposed, [out, in], grouped along
its input), with `quantization_config: {"quant_method": "mxfp4"}`.

The E2M1 rounding here is plain numpy (nearest value, shared exponent floor(log2(absmax)) - 2 as the OCP MX
rule has it); the tests judge qconvert's reading against transformers' own dequantization of these bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of a float [experts, in, out] tensor: each expert's [out, in] in groups of 32 inputs,
    codes two a byte (the earlier input in the low nibble), scales as E8M0 bytes (exponent + 127)."""
    w = np.swapaxes(np.asarray(weight, np.float64), 1, 2)  # [experts, out, in]
    experts, rows, cols = w.shape
    groups = w.reshape(experts, rows, cols // 32, 32)
    absmax = np.abs(groups).max(axis=-1)
    exponent = np.where(absmax > 0, np.floor(np.log2(np.maximum(absmax, 1e-30))) - 2, -127).clip(-127, 127)
    scaled = groups / 2.0 ** exponent[..., None]
    index = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(axis=-1)  # nearest magnitude (6 at most)
    codes = (index | np.where(scaled < 0, 8, 0)).astype(np.uint8)
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def make_gpt_oss_checkpoint(folder, *, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                            intermediate: int = 64, vocab: int = 128, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A tiny random GptOssForCausalLM saved by transformers (sliding and full attention layers, sinks, biased
    experts fused as gate_up_proj [experts, hidden, 2 x intermediate] and down_proj), weights redrawn at scales
    that keep every layer busy."""
    import torch
    import transformers

    folder = Path(folder)
    config = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=experts,
        num_experts_per_tok=top_k, sliding_window=8, max_position_embeddings=4096 * 32, tie_word_embeddings=False,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1 + 0.1 * rng.standard_normal(param.shape)
            elif "embed_tokens" in name:
                values = 0.5 * rng.standard_normal(param.shape)
            elif name.endswith("sinks") or name.endswith("bias"):
                values = 0.2 * rng.standard_normal(param.shape)
            else:
                fan_in = param.shape[-2] if param.ndim == 3 else param.shape[-1]
                values = rng.standard_normal(param.shape) / np.sqrt(fan_in)
            param.copy_(torch.from_numpy(values.astype(np.float32)))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def write_mxfp4_source(float_folder, dst) -> Path:
    """`float_folder` with its experts' gate_up_proj and down_proj written as MXFP4 blocks and scales (their
    biases as stored) and the mxfp4 quantization_config: the shipped gpt-oss form."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(float_folder), Path(dst)
    dst.mkdir(parents=True)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                blocks, scales = quantize_mxfp4(tensor.float().numpy())
                tensors[name + "_blocks"] = torch.from_numpy(blocks)
                tensors[name + "_scales"] = torch.from_numpy(scales)
            else:
                tensors[name] = tensor
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                     "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_dequantized_copy(mxfp4_folder, dst) -> Path:
    """The float checkpoint an MXFP4 gpt-oss folder stands for: each blocks and scales pair dequantized by
    transformers' own convert_moe_packed_tensors to bfloat16 (what loading the release without MXFP4 kernels
    gives), its config without the quantization_config."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = Path(mxfp4_folder), Path(dst)
    dst.mkdir(parents=True)
    stored = load_file(str(src / "model.safetensors"))
    tensors = {name: t for name, t in stored.items() if not name.endswith(("_blocks", "_scales"))}
    for name in stored:
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            tensors[base] = convert_moe_packed_tensors(stored[name], stored[base + "_scales"]).contiguous()
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# Names of a quantized expert's tensors in the forms a peer might read: vLLM's gpt-oss loader's own per-expert
# parameter names (gate/up interleaved in one w13); compressed-tensors modules, one fused gate_up_proj per expert;
# and llm-compressor's linearized experts (gate_proj, up_proj, down_proj linears, gate and up de-interleaved).
EXPERT_FORMS = {
    "vllm": lambda prefix, e, proj, leaf: f"{prefix}.{e}.{'w2' if proj == 'down_proj' else 'w13'}_{leaf}",
    "modules": lambda prefix, e, proj, leaf: f"{prefix}.{e}.{proj}.{leaf}",
    "linear": lambda prefix, e, proj, leaf: f"{prefix}.{e}.{proj}.{leaf}",
}


def int4_group_pack(weight, group: int = 64) -> dict:
    """A float [out, in] weight as symmetric int4 in groups of `group` inputs (nearest code of absmax / 7.5, the
    bf16 scale as stored) packed eight to an int32 by compressed-tensors' own pack_to_int32."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    groups = weight.float().reshape(weight.shape[0], -1, group)
    scale = (groups.abs().amax(-1) / 7.5).to(torch.bfloat16)
    codes = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int8)
    return {"weight_packed": pack_to_int32(codes.reshape(weight.shape), 4), "weight_scale": scale}


def write_int4_experts(folder, form: str):
    """`folder` (a gpt-oss folder of int4 groups of 64) with its fused float experts replaced by int4 ones written
    per expert in `form` (EXPERT_FORMS), biases beside them, and the experts taken out of the ignore list."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        fused = {n: tensors.pop(f"{prefix}.{n}") for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                          "down_proj_bias")}
        for e in range(fused["gate_up_proj"].shape[0]):
            gate_up, gate_up_bias = fused["gate_up_proj"][e].t(), fused["gate_up_proj_bias"][e]
            parts = {"down_proj": (fused["down_proj"][e].t(), fused["down_proj_bias"][e])}
            if form == "linear":
                parts.update(gate_proj=(gate_up[0::2], gate_up_bias[0::2]), up_proj=(gate_up[1::2], gate_up_bias[1::2]))
            else:
                parts["gate_up_proj"] = (gate_up, gate_up_bias)
            for proj, (weight, bias) in parts.items():
                for leaf, value in {**int4_group_pack(weight), "bias": bias.clone()}.items():
                    tensors[EXPERT_FORMS[form](prefix, e, proj, leaf)] = value.contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    quantization = config["quantization_config"]
    quantization["ignore"] = [i for i in quantization["ignore"] if "experts" not in i]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
