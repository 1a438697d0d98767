"""Supported architectures: which tensors are linears, how they are smoothed, a JAX forward.

One module per family (llama.py, qwen2.py, bert.py, mixtral.py, gemma.py, gemma3_mm.py, phi3.py, qwen3.py,
qwen2_moe.py, qwen3_moe.py, deepseek_v3.py) holds all of it as one class (`family.Family` says what it
answers); registry.py lists them and `registry.family_for(config)` finds the one config.json names.
`build(config, tensor_names)` gives the family's model (LlamaModel, Qwen2Model, BertModel, MixtralModel,
GemmaModel, Gemma3MultimodalModel, Qwen3Model, Phi3Model, Qwen2MoeModel, Qwen3MoeModel, DeepseekV3Model), a
frozen dataclass whose methods are pure functions of `params` (building raises InvalidCheckpointError, exit 6,
naming the key, for a config.json value of the wrong type or an inconsistent one), any Mapping from
checkpoint tensor name to array (lazy readers and QArray weights included):

    model.num_layers
    model.expected_shapes()                     every tensor name the forward reads -> the shape
                                                config.json implies (a tied lm_head omitted)
    model.layers_prefix                         what layer tensor names start with ("model.layers.")
    model.layer_prefix(i)                       layer i's module prefix ("model.layers.3")
    model.embed_tensor_names() / layer_tensor_names(i) / head_tensor_names()
    model.layer_linears(i)                      module names, in call order
    model.smoothing_groups() / linear_smoothing_groups()
                                                SmoothQuant's norm -> linears and linear -> linear groups
    model.embed(params, input_ids, attention_mask=None) -> hidden float32 [B, T, H]
    model.layer(i, params, hidden, attention_mask=None, linear=dense_linear,
                grouped_linear=dense_grouped_linear) -> hidden
    model.head(params, hidden, attention_mask=None, linear=dense_linear)
        -> logits [B, T, V] (causal LMs) | last_hidden_state (BERT)
    model.forward(params, input_ids, attention_mask=None, linear=..., grouped_linear=...)

Every linear runs through the `linear` hook, experts through `grouped_linear`
(hooks.py); attention hands its keys and values to `cached_kv`. Running a model one
jit-compiled layer at a time from lazily read weights (`iterate_layers`,
`forward_layerwise`) is the calibration engine's: qconvert.calibration.layers.
"""

from __future__ import annotations

from typing import Any, Iterable

from qconvert.models.bert import BertModel, mean_pool
from qconvert.models.deepseek_v3 import DeepseekV3Model
from qconvert.models.gemma import GemmaModel
from qconvert.models.gemma3_mm import Gemma3MultimodalModel
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, dense_grouped_linear,
                                   dense_linear)
from qconvert.models.llama import LlamaModel
from qconvert.models.mixtral import MixtralModel
from qconvert.models.phi3 import Phi3Model
from qconvert.models.qwen2_moe import Qwen2MoeModel
from qconvert.models.qwen2 import Qwen2Model
from qconvert.models.qwen3 import Qwen3Model
from qconvert.models.qwen3_moe import Qwen3MoeModel
from qconvert.models.registry import family_for


def build(config: dict[str, Any], tensor_names: Iterable[str] | None = None):
    """The forward-pass model for a parsed config.json (UnsupportedModelError if not supported).

    `tensor_names` (the checkpoint's, or the keys of its params) let a family whose tensors are named by who
    saved the checkpoint (Gemma 3's multimodal one) read them under the checkpoint's own names."""
    family = family_for(config)
    return family.from_config(config) if tensor_names is None else family.from_checkpoint(config, tensor_names)


__all__ = [
    "BertModel", "DeepseekV3Model", "Gemma3MultimodalModel", "GemmaModel", "GroupedLinearHook",
    "LinearHook", "LlamaModel", "MixtralModel", "Phi3Model", "Qwen2Model", "Qwen2MoeModel", "Qwen3Model",
    "Qwen3MoeModel", "build",
    "dense_grouped_linear", "dense_linear", "mean_pool",
]
