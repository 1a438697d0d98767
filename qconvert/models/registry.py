"""The registry of model families: decides from config.json alone whether a model is supported.

Each family module defines its Architecture (names, linears, smoothing groups,
remedy, default alpha, forward); this module only lists them and finds the one
a config.json names.
"""

from __future__ import annotations

from typing import Any

from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError
from qconvert.models.bert import BERT
from qconvert.models.family import Architecture, SmoothingGroup
from qconvert.models.gemma import GEMMA
from qconvert.models.llama import LLAMA
from qconvert.models.mixtral import MIXTRAL
from qconvert.models.phi3 import PHI3
from qconvert.models.qwen2_moe import QWEN2_MOE
from qconvert.models.qwen3 import QWEN3
from qconvert.models.qwen3_moe import QWEN3_MOE

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, BERT, MIXTRAL, GEMMA, PHI3, QWEN2_MOE, QWEN3, QWEN3_MOE)


def supported_architectures() -> list[str]:
    """Every Hugging Face architecture name qconvert converts with a forward pass, sorted."""
    return sorted(a for arch in ARCHITECTURES for a in arch.hf_architectures)


def architecture_for(config: dict[str, Any]) -> Architecture:
    """The Architecture for a parsed config.json, or UnsupportedModelError naming what is supported."""
    names = config.get("architectures") or []
    if isinstance(names, str) or (isinstance(names, list) and names and not isinstance(names[0], str)):
        raise InvalidCheckpointError(
            f"config.json: \"architectures\" is {names!r}; it must be a list of names, "
            f"e.g. [\"{names if isinstance(names, str) else 'LlamaForCausalLM'}\"]")
    if not isinstance(names, list) or not names:
        raise UnsupportedModelError(
            "config.json names no architecture (\"architectures\" is missing); supported: "
            + ", ".join(supported_architectures())
        )
    for arch in ARCHITECTURES:
        if names[0] in arch.hf_architectures:
            return arch
    raise UnsupportedModelError(
        f"unsupported architecture {names[0]}; supported: " + ", ".join(supported_architectures())
    )


__all__ = ["ARCHITECTURES", "Architecture", "SmoothingGroup", "architecture_for", "supported_architectures"]
