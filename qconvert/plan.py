"""The conversion plan: what a conversion will write, which linears are quantized, which tensors stay float, in what order.

Selection: the architecture's block linears, plus modules an --include pattern
names, minus modules an --exclude pattern names. Patterns match module names
(e.g. "model.layers.0.mlp.down_proj"): a glob, or "re:REGEX" matched from the
start of the name (as compressed-tensors reads its `ignore` entries).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import re
from typing import Any

import numpy as np

from qconvert.source.consistency import check_weights_match_config
from qconvert.formats.errors import (
    InvalidWeightError,
    QConvertError,
    UnsupportedModelError,
    UsageError,
)
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, TensorSpec
from qconvert.models.module_roles import expert_count, head_name, is_conv1d, is_router
from qconvert.models.family import FamilyFacts
from qconvert.models.weight_only import architecture_name
from qconvert.schemes.base import Scheme
from qconvert.schemes.servers import family_of, scheme_key, tpu_note
from qconvert.source.resolve import SourceModel

FLOAT_WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
# The kind of a tensor written as the source holds it (float or not: int64 position_ids too).
UNCHANGED = "unchanged"
def matches(pattern: str, module: str) -> bool:
    """A module name against one --include/--exclude pattern (glob, or re: from the start)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return fnmatch.fnmatchcase(module, pattern)


def check_patterns(include: tuple[str, ...], exclude: tuple[str, ...]) -> None:
    """A `re:` pattern must compile (UsageError, exit 2, naming the flag and the pattern)."""
    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as err:
                    raise UsageError(f"{flag} {pattern} is not a valid regular expression ({err}); "
                                     "fix the pattern") from None


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One source tensor (or quantized linear) and the output tensors it becomes."""

    source: str  # the source tensor name; for a quantized linear, its `.weight`
    module: str | None  # set for a quantized linear
    kind: str  # UNCHANGED, or the scheme for a quantized linear
    shape: tuple[int, ...]
    source_dtype: str
    source_bytes: int
    specs: tuple[TensorSpec, ...]

    @property
    def output_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


@dataclasses.dataclass(frozen=True)
class ConversionPlan:
    """Every output tensor in write order, and the linears left in float (for `ignore`)."""

    tensors: tuple[PlannedTensor, ...]
    ignore: tuple[str, ...]
    dropped: tuple[str, ...]  # source tensors not written (a tied lm_head)
    float_dtype: str  # the dtype of the quantized linears' float weights
    flags: LayoutFlags = LayoutFlags()  # the layout flags every quantized linear is written with
    notes: tuple[str, ...] = ()  # lines for the user about this model's choices (int4's group size)
    server_note: str = ""  # one line when vLLM TPU will not load the folder: what it takes instead
    refusal: QConvertError | None = None  # a dry run's: what a real run would refuse, once listed
    kept_float: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # routers, conv1d, towers

    @property
    def specs(self) -> list[TensorSpec]:
        return [spec for t in self.tensors for spec in t.specs]

    @property
    def quantized_modules(self) -> list[str]:
        return [t.module for t in self.tensors if t.module is not None]


def linear_candidates(ckpt: SafetensorsCheckpoint) -> list[str]:
    """Modules whose `.weight` is a 2-D float matrix and that are not embedding tables."""
    modules = []
    for name in ckpt.tensor_names:
        module = name[: -len(".weight")]
        if (name.endswith(".weight") and len(ckpt.shape(name)) == 2 and "embed" not in module
                and ckpt.dtype(name).name in FLOAT_WEIGHT_DTYPES):
            modules.append(module)
    return modules


@dataclasses.dataclass(frozen=True)
class Selection:
    """The linears to quantize, and those a pattern or the architecture named that stay float for the loaders."""

    modules: tuple[str, ...]
    routers: tuple[str, ...] = ()  # routers and expert gates (module_roles.is_router)
    conv1d: tuple[str, ...] = ()  # GPT-2-style Conv1D, stored [in, out]
    towers: tuple[str, ...] = ()  # in a sub-model the family keeps float (a multimodal model's vision tower)

    def notes(self) -> tuple[str, ...]:
        """One line per kind of linear kept float, with the reason."""
        lines = []
        if self.routers:
            lines.append(f"kept float: {_some(self.routers)} (routers: loaders build them unquantized, "
                         "so a quantized router would be read back as random weights)")
        if self.conv1d:
            lines.append(f"kept float: {_some(self.conv1d)} (Conv1D, its weight stored [in, out]: "
                         "compressed-tensors leaves Conv1D float, and no transposed copy is written for bitsandbytes)")
        if self.towers:
            lines.append(f"kept float: {_some(self.towers)} (the vision tower and projector: only the language "
                         "model is calibrated and quantized)")
        return tuple(lines)


def _some(modules: tuple[str, ...]) -> str:
    more = f" and {len(modules) - 1} more" if len(modules) > 1 else ""
    return f"{modules[0]}{more}"


def loader_float(ckpt: SafetensorsCheckpoint, config: dict[str, Any], modules) -> tuple[list[str], list[str]]:
    """(routers, Conv1Ds) among `modules`: linears no loader reads back quantized, so they stay float."""
    experts = expert_count(config)
    routers = [m for m in modules if is_router(m, ckpt.shape(f"{m}.weight")[0], experts)]
    conv1d = [m for m in modules if is_conv1d(m) and m not in routers]
    return routers, conv1d


def select_modules(ckpt: SafetensorsCheckpoint, family: FamilyFacts, include: tuple[str, ...],
                   exclude: tuple[str, ...], dropped: set[str], config: dict[str, Any] | None = None) -> Selection:
    """The sorted module names to quantize; a pattern that selects nothing is a UsageError.

    Routers and Conv1Ds stay float whatever the architecture or --include chose (loader_float).
    """
    check_patterns(include, exclude)
    towers = [m for m in linear_candidates(ckpt) if in_float_tower(family, m)]
    candidates = [m for m in linear_candidates(ckpt) if f"{m}.weight" not in dropped and m not in towers]
    routers, conv1d = loader_float(ckpt, config or {}, candidates)
    never = set(routers) | set(conv1d)
    selected = set(family.linear_names(ckpt.tensor_names))
    for pattern in include:
        selected |= _included(ckpt, pattern, candidates, towers, never, dropped)
    kept = selected & never
    selected -= never
    for pattern in exclude:
        hit = {m for m in selected | kept if matches(pattern, m)}
        if not hit:
            raise UsageError(f"--exclude {pattern} matches no quantized module; check the pattern")
        selected -= hit
        kept -= hit
    if not selected and not kept:
        raise UsageError("no linear module is left to quantize (--exclude "
                         f"{' '.join(exclude)} removes them all); narrow the pattern")
    return Selection(tuple(sorted(selected)), tuple(sorted(kept & set(routers))), tuple(sorted(kept & set(conv1d))),
                     tuple(sorted(towers)))


def _included(ckpt: SafetensorsCheckpoint, pattern: str, candidates: list[str], towers: list[str],
              never: set[str], dropped: set[str]) -> set[str]:
    """The candidate linears one --include pattern adds; a UsageError saying why when it adds none."""
    hit = {m for m in candidates if matches(pattern, m)}
    if not hit and any(matches(pattern, m) for m in towers):
        raise UsageError(f"--include {pattern} matches only linears of the vision tower or projector "
                         f"({min(m for m in towers if matches(pattern, m))}), which stay float with the rest "
                         "of their sub-model; only the language model is quantized")
    if not hit:
        tied = any(matches(pattern, name[: -len(".weight")]) for name in dropped) or (
            matches(pattern, "lm_head") and "lm_head.weight" not in ckpt.tensor_names)
        if tied:  # the pattern is right: the model has no lm_head of its own
            raise UsageError(f"--include {pattern}: this model has no lm_head weight of its own (its output "
                             "layer is the input embeddings, tied, which stay float with them); leave it out "
                             "of --include")
        raise UsageError(f"--include {pattern} matches no linear module; check the pattern")
    if hit <= never:
        raise UsageError(f"--include {pattern} matches only routers or Conv1D linears ({min(hit)}), "
                         "which stay float: no loader reads them back quantized; leave it out of --include")
    return hit


def _check_something_left(selection: Selection, config: dict[str, Any]) -> None:
    """UnsupportedModelError when every linear chosen is one that stays float (a GPT-2 of Conv1Ds only)."""
    if not selection.modules:
        kept = selection.routers + selection.conv1d
        raise UnsupportedModelError(
            f"{architecture_name(config)}: nothing left to quantize: every linear is a router or a GPT-2-style "
            f"Conv1D with an [in, out] weight ({_some(kept)}), and those stay float: the loaders do not read "
            "them back quantized")


def _check_linear(ckpt: SafetensorsCheckpoint, module: str) -> tuple[int, int]:
    name = f"{module}.weight"
    shape, dtype = ckpt.shape(name), ckpt.dtype(name).name
    if dtype not in FLOAT_WEIGHT_DTYPES:
        raise InvalidWeightError(f"{name} is {dtype}; quantization takes float32, float16 or bfloat16 weights")
    if len(shape) != 2 or 0 in shape:
        raise InvalidWeightError(
            f"{name} has shape {list(shape)}; a quantized linear needs a non-empty 2-D [out, in] weight"
        )
    bias = f"{module}.bias"
    if bias in ckpt and ckpt.shape(bias) != (shape[0],):
        raise InvalidWeightError(f"{bias} has shape {list(ckpt.shape(bias))}; it must be [{shape[0]}] to fit {name}")
    return shape


class _Refusals:
    """The first refusal met while planning. A dry run plans on past it, so that it can list what it would do."""

    def __init__(self, keep_going: bool):
        self.keep_going = keep_going
        self.first: QConvertError | None = None

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except QConvertError as err:
            if not self.keep_going:
                raise
            self.first = self.first or err


def _check_not_quantized(config: dict[str, Any]) -> None:
    """UnsupportedModelError for a checkpoint that is already quantized: only a float one is converted."""
    if "quantization_config" in config:
        raise UnsupportedModelError("the model is already quantized (config.json has quantization_config); "
                                    "give the float checkpoint")


def _tied_lm_head(ckpt: SafetensorsCheckpoint, config: dict[str, Any]) -> set[str]:
    """{"lm_head.weight"} when the head is tied: it is the embedding table, which loaders re-tie, so it is not
    written twice; else nothing."""
    return {"lm_head.weight"} if config.get("tie_word_embeddings") is True and "lm_head.weight" in ckpt else set()


def plan_conversion(source: SourceModel, *, scheme: Scheme, include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                    double_quant: bool = False, static_act: bool = False,
                    group_size: int | str | None = None, dry_run: bool = False) -> ConversionPlan:
    """Decide every output tensor, its layout and order (sorted by source name), before any byte is read.

    With `dry_run`, a refusal after the selection (a weight's shape, the group size, the scheme's own
    checks, the config against the weights) is kept in the plan's `refusal` instead of raised.
    """
    ckpt, config = source.checkpoint, source.config
    _check_not_quantized(config)
    dropped = _tied_lm_head(ckpt, config)
    selection = select_modules(ckpt, source.family, tuple(include), tuple(exclude), dropped, config)
    refusals = _Refusals(dry_run)
    with refusals.check():
        _check_something_left(selection, config)
    shapes = _linear_shapes(ckpt, selection.modules, refusals)
    modules = [m for m in selection.modules if m in shapes]
    flags = _layout_flags(scheme, refusals, shapes, act="static" if static_act else "dynamic",
                          double_quant=double_quant, group_size=group_size)
    with refusals.check():
        scheme.check_modules(modules, flags)
    tensors = _planned_tensors(ckpt, scheme, dropped, set(modules), shapes, flags)
    # After the per-linear checks (a weight of the wrong rank or dtype is exit 7), before any byte is read.
    # A weight-only architecture (--any-architecture) has no family to hold the config against.
    if source.weight_only is None:
        with refusals.check():
            check_weights_match_config(ckpt, config, lambda: source.model)
    notes: tuple[str, ...] = selection.notes()
    with refusals.check():
        notes += (scheme.group_note(group_size, shapes),)
    return ConversionPlan(tensors=tuple(tensors), ignore=loader_ignore(ckpt, config, modules, source.family),
                          dropped=tuple(sorted(dropped)),
                          float_dtype=ckpt.dtype(f"{modules[0]}.weight").name if modules else "float32",
                          flags=flags, notes=tuple(filter(None, notes)),
                          server_note=tpu_note(scheme_key(scheme.name, flags), family_of(config)),
                          refusal=refusals.first,
                          kept_float={"routers": selection.routers, "conv1d": selection.conv1d,
                                      "towers": selection.towers})


def _linear_shapes(ckpt: SafetensorsCheckpoint, modules, refusals: _Refusals) -> dict[str, tuple[int, int]]:
    """Each quantized linear's [out, in]; a dry run keeps a refused 2-D weight in the list (its shape as stored)."""
    shapes = {}
    for module in modules:
        with refusals.check():
            shapes[module] = _check_linear(ckpt, module)
        stored = tuple(ckpt.shape(f"{module}.weight"))
        if module not in shapes and len(stored) == 2 and 0 not in stored:
            shapes[module] = stored
    return shapes


def _layout_flags(scheme: Scheme, refusals: _Refusals, shapes, *, act: str, double_quant: bool,
                  group_size: int | str | None) -> LayoutFlags:
    """The run's layout flags; a dry run whose group size is refused lists with the default one."""
    flags = None
    with refusals.check():
        flags = scheme.layout_flags(act=act, double_quant=double_quant, group_size=group_size, shapes=shapes)
    if flags is None:
        flags = scheme.layout_flags(act=act, double_quant=double_quant, group_size="channel"
                                    if scheme.takes_group_size else None, shapes=shapes)
    return flags


def _planned_tensors(ckpt: SafetensorsCheckpoint, scheme: Scheme, dropped: set[str], modules: set[str],
                     shapes: dict[str, tuple[int, int]], flags: LayoutFlags) -> list[PlannedTensor]:
    tensors = []
    for name in ckpt.tensor_names:
        if name in dropped:
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        shape, dtype = ckpt.shape(name), ckpt.dtype(name)
        if module in modules:
            specs = scheme.layout.tensor_specs(module, shapes[module], dtype, flags)
            tensors.append(PlannedTensor(name, module, scheme.name, shape, dtype.name, ckpt.nbytes(name),
                                         tuple(specs)))
        else:
            spec = TensorSpec(name, dtype, shape)
            tensors.append(PlannedTensor(name, None, UNCHANGED, shape, dtype.name, ckpt.nbytes(name), (spec,)))
    return tensors


def in_float_tower(family: FamilyFacts, module: str) -> bool:
    """Whether `module` lies in a sub-model the family keeps float (a multimodal model's vision tower)."""
    return any(re.match(tower, module) for tower in getattr(family, "float_towers", ()))


def loader_ignore(ckpt: SafetensorsCheckpoint, config: dict[str, Any], modules,
                  family: FamilyFacts | None = None) -> tuple[str, ...]:
    """The loaders' ignore list: every linear-shaped module left float, and the output head unless quantized.

    Loaders build the head whether or not it is stored (tied), under the family's own name
    (`lm_head`, BioGPT's `output_projection`), so it is named first. A sub-model the family keeps float
    (`float_towers`) is one `re:` entry: the loaders name its modules each their own way (transformers
    5 drops SigLIP's `vision_model.`, vLLM keeps it), and the pattern matches them all.
    """
    head = head_name(config)
    towers = tuple(getattr(family, "float_towers", ()))
    float_linears = {m for m in linear_candidates(ckpt) if not in_float_tower(family, m)}
    ignore = sorted(float_linears - set(modules) - {head})
    if head not in modules:
        ignore.insert(0, head)
    return tuple(ignore) + tuple(f"re:{tower}" for tower in towers)


def is_float_array(array: np.ndarray) -> bool:
    """Whether NaN/Inf can occur in the array (a floating dtype, bf16 included)."""
    return np.dtype(array.dtype).name in FLOAT_WEIGHT_DTYPES + ("float64",)
