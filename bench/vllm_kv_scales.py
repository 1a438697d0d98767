"""A folder's FP8 KV-cache scales as vLLM's Attention layers take them, for bench/vllm_kv_cache.py and
bench/vllm_tpu_kv_cache.py: the parameter each checkpoint scale loads into, the Attention layers, a recorder of
what their k_scale / v_scale weight_loaders receive (vLLM 0.33 and vLLM TPU 0.32 build the same Attention), and a
check's report line."""

from __future__ import annotations

import re
from collections.abc import Callable

SCALE_NAMES = ("k_scale", "v_scale")
E4M3_MAX = 448.0


def expected_param(name: str) -> str | None:
    """The Attention parameter a checkpoint KV scale belongs to: `<x>.self_attn.k_scale` ->
    `<x>.self_attn.attn.k_scale` (vLLM's Attention module sits at `self_attn.attn`)."""
    found = re.fullmatch(r"(.*\.self_attn)\.([kv]_scale)", name)
    return f"{found.group(1)}.attn.{found.group(2)}" if found else None


def attention_layers(model) -> dict[str, object]:
    """vLLM's Attention modules of `model`, by name."""
    from vllm.model_executor.layers.attention.attention import Attention

    return {name: mod for name, mod in model.named_modules() if isinstance(mod, Attention)}


def record_kv_loaders(model, current: Callable[[], str | None], loads: list) -> None:
    """Wrap each Attention layer's k_scale / v_scale weight_loader to append (the checkpoint tensor being loaded,
    current(); the parameter's name; a copy of the tensor it receives) to `loads`."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    for mn, mod in attention_layers(model).items():
        for pn in SCALE_NAMES:
            param = getattr(mod, pn, None)
            if param is None:
                continue
            plain = getattr(param, "weight_loader", None) or default_weight_loader

            def loader(p, loaded, *a, _plain=plain, _name=f"{mn}.{pn}", **k):
                loads.append((current(), _name, loaded.detach().clone()))
                return _plain(p, loaded, *a, **k)

            param.weight_loader = loader


def report(emit, name: str, bad: list[str], problems: str, shown: int, ok: str, fail: str = "FAIL-WRONG") -> None:
    """One check's line: `fail` naming how many `problems` and the first `shown` of them, else OK with `ok`."""
    if bad:
        emit(fail, name, f"{len(bad)} {problems}: " + "; ".join(bad[:shown]))
    else:
        emit("OK", name, ok)
