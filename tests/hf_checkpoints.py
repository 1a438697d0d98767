"""Tiny random checkpoints built by transformers itself (its config class, model and save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


# Per family: the transformers config class and the fields of a tiny model of it.
TINY = {
    "llama": ("LlamaConfig", dict()),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=8)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, attention_bias=False)),  # head_dim != hidden / heads, as in Qwen3
    "phi3": ("Phi3Config", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=24, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, norm_topk_prob=True)),
    # Layer 0 dense, the rest experts in two groups (one chosen per token); the router (vLLM reads topk_method to
    # build its correction bias) and yarn RoPE as the released configs.
    "deepseek_v3": ("DeepseekV3Config", dict(
        first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


def make_hf_checkpoint(folder, family: str, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, intermediate: int = 96, vocab: int = 128, seed: int = 0,
                       peaked: bool = False, dtype: str = "float32", **overrides) -> Path:
    """Build a tiny random `family` model with transformers and save it (safetensors in `dtype`, float32 by default).

    The weights are redrawn from a seeded numpy generator at scales that keep
    every layer busy: norms 1 +- 0.1, embeddings 0.5, projections 1/sqrt(in),
    softmax routers 0.5 so that the top-k experts are well separated. `peaked` gives
    sharp next-token distributions (see below).
    """
    import torch
    import transformers

    config_class, fields = TINY[family]
    config = getattr(transformers, config_class)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        tie_word_embeddings=False, **{**fields, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if param.ndim == 1:
                value = 1 + 0.1 * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                value = 0.5 * rng.standard_normal(shape)
            elif name.endswith("mlp.gate.weight") and config.model_type != "deepseek_v3":
                value = 0.5 * rng.standard_normal(shape)
            elif name.endswith("mlp.gate.weight"):
                # A sigmoid router saturates on wide logits (every score near 1, the choice left to the
                # correction bias and flipped by any rounding): logits of about unit scale, as projections.
                value = rng.standard_normal(shape) / np.sqrt(shape[-1])
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[-1])
            param.copy_(torch.from_numpy(value.astype(np.float32)))
        for name, buffer in model.named_buffers():
            # DeepSeek-V3's router bias shifts which experts win (not their weights): as large as the score gaps.
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.from_numpy((0.1 * rng.standard_normal(tuple(buffer.shape))).astype(np.float32)))
        if peaked:
            # lm_head reads the embedding directions back: the residual stream's own token gets
            # a clear lead over the rest, as in trained LMs, so next-token top-1 is not a coin toss.
            head = model.lm_head.weight
            head.copy_(model.model.embed_tokens.weight * 0.5 + head)
    folder = Path(folder)
    model.to(getattr(torch, dtype)).save_pretrained(str(folder))
    return folder


def load_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def reference_logits(folder, ids, mask, **load_args) -> np.ndarray:
    """transformers' float32 logits of the checkpoint in `folder` (`load_args` go to from_pretrained)."""
    import torch
    import transformers

    model = generic_bitsandbytes_path(
        transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **load_args).eval())
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                     attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long)).logits.numpy()


def generic_bitsandbytes_path(model):
    """`model` with every bitsandbytes 4-bit linear on its generic float32 dequantize path.

    On CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight whose out is a multiple of 32 for a bf16
    gemm and computes in bf16 (3e-3 of the logits' scale apart from float32): a judge of the stored codes
    must read them the same way on every CPU."""
    try:
        import bitsandbytes
    except ImportError:
        return model
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            if not bitsandbytes_reads_back_nf4(module.out_features, module.in_features):
                import pytest

                pytest.skip(f"bitsandbytes on this CPU does not read back its own NF4 quantization of a "
                            f"[{module.out_features}, {module.in_features}] weight (quantize_4bit then "
                            "dequantize_4bit is off by more than NF4's step): it cannot judge this folder here")
    return model


_READS_BACK: dict[tuple[int, int], bool] = {}


def bitsandbytes_reads_back_nf4(out_features: int, in_features: int) -> bool:
    """Whether bitsandbytes' own quantize_4bit -> dequantize_4bit of a random [out, in] weight stays within
    NF4's rounding (half its widest step: 0.14 of a block's absmax). bitsandbytes 0.50's CPU path on
    AVX512 hosts breaks when in_features is a multiple of 32 but not of 64 (96, 160: off by 0.5)."""
    key = (out_features, in_features)
    if key not in _READS_BACK:
        import torch
        import bitsandbytes.functional as bnb_functional

        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
        packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
        back = bnb_functional.dequantize_4bit(packed, state)
        _READS_BACK[key] = bool((back - weight).abs().max() <= 0.2 * weight.abs().max())
    return _READS_BACK[key]


def token_batch(vocab: int, batch: int = 2, seq: int = 10, seed: int = 1):
    """Random ids [batch, seq] and a mask with right padding in the second sample."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[-1, -3:] = 0
    return ids, mask


def family_source(root: Path, family: str) -> Path:
    """A one-layer `family` model at hidden 128 for the scheme-by-family tests (peaked next-token outputs).

    intermediate 256, except Qwen3-MoE: it has no dense MLP, so its intermediate_size may not exceed what
    its tensors hold.
    """
    return make_hf_checkpoint(Path(root) / "src", family, hidden=128, layers=1, peaked=True,
                              intermediate=128 if family == "qwen3_moe" else 256)


def dequantized_float_folder(source, out, folder) -> Path:
    """The float model as folder `out` holds it: each quantized linear qconvert's own dequantization of it, every
    other tensor the folder's own (norms AWQ or SmoothQuant scaled differ from the source's)."""
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from qconvert.formats.layouts import open_quantized

    weights = load_file(str(Path(source) / "model.safetensors"))
    quantized = open_quantized(out)
    replaced = {f"{module}.weight" for module in quantized.quantized_modules}
    for shard in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys() if name in weights and name not in replaced})
    for module in quantized.quantized_modules:
        weights[f"{module}.weight"] = np.asarray(quantized.qarray(module).dequantize(np.float32))
    quantized.close()
    folder = Path(folder)
    folder.mkdir()
    shutil.copy(Path(source) / "config.json", folder / "config.json")
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def make_fp4_moe_checkpoint(folder) -> Path:
    """A bf16 Qwen3-MoE whose widths groups of 32 divide (hidden 128, expert width 64; the default experts are 24
    wide, which FP4 refuses): 4 experts, top 2, two layers."""
    return make_hf_checkpoint(folder, "qwen3_moe", hidden=128, intermediate=128, moe_intermediate_size=64,
                              dtype="bfloat16", peaked=True)
