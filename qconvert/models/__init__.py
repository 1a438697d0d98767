"""Supported architectures: which tensors are linears, how they are smoothed, a JAX forward."""

from __future__ import annotations

from typing import Any

from qconvert.models.bert import BertModel, mean_pool
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, dense_grouped_linear,
                                   dense_linear)
from qconvert.models.llama import LlamaModel
from qconvert.models.mixtral import MixtralModel
from qconvert.models.registry import architecture_for
from qconvert.models.runner import LayerResult, forward_layerwise, iterate_layers, read_tensors

_FAMILIES = {"llama": LlamaModel, "bert": BertModel, "mixtral": MixtralModel}


def build(config: dict[str, Any]):
    """The forward-pass model for a parsed config.json (UnsupportedModelError if not supported)."""
    return _FAMILIES[architecture_for(config).family].from_config(config)


__all__ = [
    "BertModel", "GroupedLinearHook", "LayerResult", "LinearHook", "LlamaModel", "MixtralModel", "build",
    "dense_grouped_linear", "dense_linear", "forward_layerwise", "iterate_layers", "mean_pool", "read_tensors",
]
