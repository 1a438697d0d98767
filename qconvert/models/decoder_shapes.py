"""The tensor shapes a Llama-style decoder's config.json implies (pieces of the families' expected_shapes)."""

from __future__ import annotations

from qconvert.models.llama import LlamaModel

Shapes = dict[str, tuple[int, ...]]


def embed_and_head_shapes(model: LlamaModel) -> Shapes:
    """Embedding, final norm and (unless tied) lm_head."""
    a, p = model.args, model.prefix
    shapes = {f"{p}.embed_tokens.weight": (a.vocab_size, a.hidden_size), f"{p}.norm.weight": (a.hidden_size,)}
    if not a.tie_word_embeddings:
        shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
    return shapes


def layer_norm_shapes(model: LlamaModel, i: int) -> Shapes:
    """Layer i's input_layernorm and post_attention_layernorm."""
    p = model.layer_prefix(i)
    return {f"{p}.{norm}.weight": (model.args.hidden_size,)
            for norm in ("input_layernorm", "post_attention_layernorm")}


def attention_shapes(model: LlamaModel, i: int) -> Shapes:
    """Layer i's q/k/v/o_proj weights and the biases the family reads."""
    a, p = model.args, f"{model.layer_prefix(i)}.self_attn"
    outs = {"q_proj": a.num_attention_heads * a.head_dim, "k_proj": a.num_key_value_heads * a.head_dim,
            "v_proj": a.num_key_value_heads * a.head_dim, "o_proj": a.hidden_size}
    shapes: Shapes = {}
    for proj, out in outs.items():
        shapes[f"{p}.{proj}.weight"] = (out, a.num_attention_heads * a.head_dim if proj == "o_proj"
                                        else a.hidden_size)
        if model.biased(proj):
            shapes[f"{p}.{proj}.bias"] = (out,)
    return shapes


def swiglu_shapes(prefix: str, hidden: int, intermediate: int) -> Shapes:
    """gate_proj, up_proj [intermediate, hidden] and down_proj [hidden, intermediate] under `prefix`."""
    return {f"{prefix}.gate_proj.weight": (intermediate, hidden), f"{prefix}.up_proj.weight": (intermediate, hidden),
            f"{prefix}.down_proj.weight": (hidden, intermediate)}
