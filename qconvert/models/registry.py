"""The registry of model families: decides from config.json alone whether a model is supported.

Each family module defines its family class (names, linears, smoothing groups,
remedy, default alpha, forward); this module only lists them and finds the one
a config.json names.
"""

from __future__ import annotations

from typing import Any

from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError
from qconvert.models.bert import BertModel
from qconvert.models.deepseek_v3 import DeepseekV3Model
from qconvert.models.family import Family
from qconvert.models.gemma import GemmaModel
from qconvert.models.gemma3_mm import Gemma3MultimodalModel
from qconvert.models.gpt_oss import GptOssModel
from qconvert.models.llama import LlamaModel
from qconvert.models.mixtral import MixtralModel
from qconvert.models.phi3 import Phi3Model
from qconvert.models.qwen2 import Qwen2Model
from qconvert.models.qwen2_moe import Qwen2MoeModel
from qconvert.models.qwen3 import Qwen3Model
from qconvert.models.qwen3_moe import Qwen3MoeModel

FAMILIES: tuple[type[Family], ...] = (LlamaModel, Qwen2Model, BertModel, MixtralModel, GemmaModel, Phi3Model,
                                      Qwen2MoeModel, Qwen3Model, Qwen3MoeModel, Gemma3MultimodalModel,
                                      DeepseekV3Model, GptOssModel)


def supported_architectures() -> list[str]:
    """Every Hugging Face architecture name qconvert converts with a forward pass, sorted."""
    return sorted(a for family in FAMILIES for a in family.hf_architectures)


def family_for(config: dict[str, Any]) -> type[Family]:
    """The family class for a parsed config.json, or UnsupportedModelError naming what is supported."""
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
    for family in FAMILIES:
        if names[0] in family.hf_architectures:
            return family
    raise UnsupportedModelError(
        f"unsupported architecture {names[0]}; supported: " + ", ".join(supported_architectures())
    )


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json's values for the language model (vocab_size, max_position_embeddings, ...): its family's
    reading (a multimodal checkpoint's text_config with its defaults), else a nested text_config as it
    stands, else config.json itself."""
    names = config.get("architectures")
    first = names[0] if isinstance(names, list) and names else None
    for family in FAMILIES:
        if first in family.hf_architectures:
            return family.language_config(config)
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


__all__ = ["FAMILIES", "family_for", "language_config", "supported_architectures"]
