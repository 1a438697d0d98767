"""Weight-only conversion of a decoder with no known family (`--any-architecture`): its linears are
found from the checkpoint itself, as every 2-D float `*.weight` under the repeated layer prefix.

A decoder stores its blocks as `<prefix>.<N>.<module>.weight` (`model.layers.0.self_attn.q_proj.weight`,
`transformer.h.3.mlp.c_fc.weight`). The prefix whose numbered children hold the most tensors is
the layer stack; every 2-D float weight under it is taken as a linear, except embedding tables.
Embeddings, norms (1-D) and the head lie outside the stack or are not 2-D, so they stay float.
There is no forward pass: int8 and nf4 need none, w8a8 (calibration) does.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from qconvert.formats.errors import UnsupportedModelError
from qconvert.models.family import Family, FamilyFacts
from qconvert.models.registry import family_for

FAMILY = "weight-only"
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_NUMBERED = re.compile(r"^((?:[^.]+\.)*?[^.0-9][^.]*)\.([0-9]+)\.(.+)\.weight$")


def architecture_name(config: Mapping[str, Any]) -> str:
    names = config.get("architectures")
    return str(names[0]) if isinstance(names, list) and names else "an unnamed architecture"


def check_architecture(config: dict[str, Any], *, any_architecture: bool, scheme: str, weight_only: bool,
                       weight_only_schemes: str) -> type[Family] | None:
    """The known family of config.json, or None for an unknown one that --any-architecture lets through.

    Refuses, before any weight is read, what cannot be converted: an unknown architecture
    without --any-architecture, or with it for a scheme that needs a forward pass (not `weight_only`).
    `weight_only_schemes` names the schemes that need none, as the message lists them."""
    try:
        return family_for(config)
    except UnsupportedModelError as err:
        if not any_architecture:
            raise UnsupportedModelError(
                f"{err}; --any-architecture converts an unknown decoder weight-only "
                f"(--scheme {weight_only_schemes})") from None
    if not weight_only:
        raise UnsupportedModelError(
            f"--scheme {scheme} needs a known family (calibration runs its forward pass) and "
            f"{architecture_name(config)} is not one; --any-architecture converts with --scheme {weight_only_schemes}")
    return None


@dataclasses.dataclass(frozen=True)
class WeightOnlySelection:
    """What the layer-prefix rule chose: the layer stack and the module paths within a layer."""

    architecture: str
    layer_prefix: str            # e.g. "model.layers"
    layers: int                  # distinct layer numbers seen
    modules: tuple[str, ...]     # module paths inside a layer, e.g. ("mlp.down_proj", ...)

    def describe(self) -> str:
        """One line for the terminal: what was taken as linears, and what stays float."""
        return (f"{self.architecture} is not a known family; weight-only: every 2-D weight under "
                f"{self.layer_prefix}.N ({self.layers} layers) is a linear: {', '.join(self.modules)}; "
                "embeddings, norms and the head stay float")

    def record(self) -> dict[str, Any]:
        """qconvert.json's account of the choice."""
        return {"architecture": self.architecture, "rule": "2-D float weights under the repeated layer prefix",
                "layer_prefix": self.layer_prefix, "layers": self.layers, "modules": list(self.modules)}


def select_linears(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                   dtypes: Mapping[str, str]) -> WeightOnlySelection:
    """Apply the layer-prefix rule to a checkpoint's tensor shapes and dtype names."""
    by_prefix: Counter[str] = Counter()
    for name in shapes:
        match = _NUMBERED.match(name)
        if match:
            by_prefix[match.group(1)] += 1
    if not by_prefix:
        raise UnsupportedModelError(
            f"{architecture_name(config)}: no numbered layers (like model.layers.N.) among the tensor names; "
            "--any-architecture takes decoders whose blocks are numbered")
    prefix = max(sorted(by_prefix), key=lambda p: by_prefix[p])
    layers, modules = set(), set()
    for name, shape in shapes.items():
        match = _NUMBERED.match(name)
        if not match or match.group(1) != prefix:
            continue
        layers.add(int(match.group(2)))
        module = match.group(3)
        if len(shape) == 2 and dtypes[name] in FLOAT_DTYPES and "embed" not in module:
            modules.add(module)
    if not modules:
        raise UnsupportedModelError(
            f"{architecture_name(config)}: no 2-D float weight under {prefix}.N; nothing to quantize weight-only")
    return WeightOnlySelection(architecture_name(config), prefix, len(layers), tuple(sorted(modules)))


@dataclasses.dataclass(frozen=True)
class WeightOnlyFamily:
    """The family facts (family.FamilyFacts) of a decoder the layer-prefix rule chose linears for: its
    linears are the selection's modules in every layer; nothing is smoothed and there is no forward."""

    selection: WeightOnlySelection
    family = FAMILY
    default_alpha = 0.5
    causal_lm = False  # no forward pass here, so no logits are judged
    remedy = ""
    float_towers = ()

    @property
    def hf_architectures(self) -> tuple[str, ...]:
        return (self.selection.architecture,)

    @property
    def linear_pattern(self) -> re.Pattern:
        modules = "|".join(re.escape(m) for m in self.selection.modules)
        return re.compile(rf"^{re.escape(self.selection.layer_prefix)}\.[0-9]+\.(?:{modules})$")

    def linear_names(self, tensor_names) -> list[str]:
        """Module names (sorted) of the selected linears among a checkpoint's tensor names."""
        modules = [name[: -len(".weight")] for name in tensor_names if name.endswith(".weight")]
        return sorted(m for m in modules if self.linear_pattern.search(m))


def checkpoint_family(config: dict[str, Any], ckpt, *, any_architecture: bool,
                      family: type[Family] | None = None) -> tuple[FamilyFacts, WeightOnlySelection | None]:
    """config.json's family (`family` when the caller found it already), or for an unknown decoder with
    any_architecture the layer-prefix rule's family and selection from a SafetensorsCheckpoint's header
    (no tensor is read)."""
    if family is not None:
        return family, None
    try:
        return family_for(config), None
    except UnsupportedModelError:
        if not any_architecture:
            raise
    names = ckpt.tensor_names
    selection = select_linears(config, {n: tuple(ckpt.shape(n)) for n in names},
                               {n: ckpt.dtype(n).name for n in names})
    return WeightOnlyFamily(selection), selection
