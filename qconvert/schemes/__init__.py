"""The scheme registry: every `--scheme`, one object each, in the order the CLI lists them.

Each scheme's module is imported when the scheme is first asked for, so the
CLI can list the names without starting JAX. To add a scheme: one module here
with its Scheme subclass (and its layout in formats/), one line in _CLASSES and one in DESCRIPTIONS,
its layout's words and measured rows in servers.py (`python docs/servers_table.py` writes the README's table
from them), and tests.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from qconvert.formats.errors import UsageError

if TYPE_CHECKING:
    from qconvert.schemes.base import Scheme

# name -> "module:class" under qconvert.schemes
_CLASSES = {"int8": "int8:Int8", "int4": "int4:Int4", "w8a8": "w8a8:W8A8", "fp8": "fp8:FP8", "nf4": "nf4:NF4",
            "int4-asym": "int4_asym:Int4Asym", "w4a8-fp8": "w4a8:W4A8FP8",
            "nvfp4a16": "nvfp4:NVFP4A16", "mxfp4a16": "nvfp4:MXFP4A16", "nvfp4": "nvfp4_w4a4:NVFP4"}
NAMES = tuple(_CLASSES)
# compressed-tensors' preset names (what llm-compressor users write), taken in any case for the scheme that writes
# that preset; an entry whose scheme this build lacks is left out.
_PRESETS = {
    "W4A16": "int4",
    "W4A16_ASYM": "int4-asym",
    "W8A16": "int8",
    "W8A8": "w8a8",
    "FP8_DYNAMIC": "fp8",
    "W4AFP8": "w4a8-fp8",
    "NVFP4A16": "nvfp4a16",
    "MXFP4A16": "mxfp4a16",
    "NVFP4": "nvfp4",
}
ALIASES = {alias: name for alias, name in _PRESETS.items() if name in _CLASSES}
# name -> (what it stores, in one line; the loaders that read its layout, as measured): the scheme's own words,
# kept here so that `quantize --help` lists them without importing the scheme modules (and JAX).
DESCRIPTIONS: dict[str, tuple[str, str]] = {
    "int8": ("int8 weights per output channel, float activations (W8A16)",
            "vLLM, transformers + compressed-tensors"),
    "int4": ("int4 weights per group of input channels (128 by default), float activations (W4A16)",
            "vLLM, transformers + compressed-tensors"),
    "w8a8": ("SmoothQuant: int8 weights and int8 activations",
            "vLLM, transformers + compressed-tensors (dense; MoE in vLLM)"),
    "fp8": ("FP8 E4M3 weights per output channel, FP8 activations per token at run time (W8A8-FP8)",
            "vLLM, vLLM TPU, transformers + compressed-tensors"),
    "nf4": ("NormalFloat-4 weights, blocks of 64 (QLoRA), optional double quantization",
            "transformers + bitsandbytes only (vLLM 0.33 removed bitsandbytes)"),
    "int4-asym": ("int4 weights with a scale and a zero point per group of input channels, float activations "
                  "(W4A16_ASYM)", "vLLM (dense and MoE), transformers + compressed-tensors"),
    "w4a8-fp8": ("int4 weights per group of 128 input channels, FP8 activations per token at run time (W4AFP8)",
                 "vLLM (Hopper), vLLM TPU, transformers + compressed-tensors"),
    "nvfp4a16": ("NVFP4 weights: E2M1 in groups of 16, E4M3 scales, a float32 global scale per tensor; float "
                 "activations (NVFP4A16)", "vLLM (dense), transformers + compressed-tensors (dense)"),
    "mxfp4a16": ("MXFP4 weights: E2M1 in groups of 32, power-of-two (E8M0) scales; float activations (MXFP4A16)",
                 "vLLM (dense and MoE), transformers + compressed-tensors"),
    "nvfp4": ("NVFP4 weights as nvfp4a16, NVFP4 activations (E2M1 per 16 inputs at run time) over a calibrated "
              "input global scale (NVFP4, W4A4)", "vLLM (dense and MoE; Blackwell kernels)"),
}

__all__ = ["ALIASES", "DESCRIPTIONS", "NAMES", "SCHEMES", "canonical_name", "names_where", "scheme_named"]


@functools.cache
def _load(name: str) -> Scheme:
    module, cls = _CLASSES[name].split(":")
    return getattr(importlib.import_module(f"qconvert.schemes.{module}"), cls)()


def canonical_name(name: str) -> str:
    """The scheme name `name` stands for: a scheme's name or a compressed-tensors preset name (ALIASES), in any
    case; UsageError naming the choices otherwise."""
    if isinstance(name, str):
        for known, canonical in [*((n, n) for n in NAMES), *ALIASES.items()]:
            if name.lower() == known.lower():
                return canonical
    raise UsageError(f"unknown scheme {name!r}; choose one of {', '.join(NAMES)} "
                     f"(or a compressed-tensors preset name: {', '.join(ALIASES)})")


def scheme_named(name: str) -> Scheme:
    """The scheme called `name` (or the preset name `name`, canonical_name's); UsageError naming the choices
    otherwise."""
    return _load(canonical_name(name))


def names_where(test: Callable[[Scheme], bool]) -> str:
    """The names of the schemes that pass `test`, as a message lists them ('int8, int4 or nf4')."""
    names = [name for name in NAMES if test(_load(name))]
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


def __getattr__(attribute: str):
    # SCHEMES (name -> Scheme, every scheme loaded) on first use.
    if attribute == "SCHEMES":
        return {name: _load(name) for name in NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
