"""The float reference and the converted folder as model params, and the tensor-level consistency check.

The models take any Mapping from checkpoint tensor name to array; both read
each tensor from its shard only when asked for (the reference through
formats' CheckpointParams), and the converted one hands out a QArray under
"<module>.weight" for every quantized linear.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.models.family import FamilyFacts
from qconvert.models.registry import family_for


class QuantizedParams(Mapping):
    """A QuantizedCheckpoint as params: QArrays for the quantized linears' weights, float tensors as stored."""

    def __init__(self, quantized):
        self.quantized = quantized
        self._weights = {f"{m}.weight": m for m in quantized.quantized_modules}
        self._floats = set(quantized.float_names)
        self._names = sorted(self._floats | set(self._weights))

    def __getitem__(self, name: str):
        if name in self._weights:
            return self.quantized.qarray(self._weights[name])
        if name not in self._floats:
            raise KeyError(name)
        return self.quantized.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._weights or name in self._floats

    def is_quantized(self, name: str) -> bool:
        """Whether `name` is a quantized linear's weight (a QArray here), without reading it."""
        return name in self._weights

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def check_tensors(quantized, reference, config: dict[str, Any], arch: FamilyFacts | None = None) -> list[str]:
    """The converted folder's tensors against the reference and the layout of its scheme.

    Every reference linear is either quantized (with every tensor its layout
    needs, of the right dtype and shape) or kept in float; every other reference
    tensor is present with its shape; every QArray decodes. Each problem names
    the file (or the folder, for a tensor that is nowhere). `arch` defaults to
    the config's known family (the weight-only rule's family is passed in).
    """
    arch = arch or family_for(config)
    quantized_modules, float_names = set(quantized.quantized_modules), set(quantized.float_names)
    # The family's linears, and any other reference linear the folder quantized (--include lm_head).
    ref_linears = list(arch.linear_names(reference.tensor_names))
    ref_linears += sorted(m for m in quantized_modules - set(ref_linears) if f"{m}.weight" in reference)
    problems = [f"{quantized.folder.name}: quantized linear {module} has no {module}.weight in the reference"
                for module in sorted(quantized_modules - set(ref_linears))]
    for module in ref_linears:
        shape = tuple(reference.shape(f"{module}.weight"))
        problems += (_quantized_linear_problems(quantized, module, shape) if module in quantized_modules
                     else _float_linear_problems(quantized, module, shape, float_names))
    return problems + _other_tensor_problems(quantized, reference, config, ref_linears, float_names)


def _float_linear_problems(quantized, module: str, shape: tuple[int, ...], float_names: set[str]) -> list[str]:
    """A reference linear the folder did not quantize: its float weight, of the reference's shape."""
    weight, ckpt = f"{module}.weight", quantized.checkpoint
    # bf16 is kind "V" to numpy; an int8 .weight without its scale is not a float linear.
    if (weight in float_names and tuple(ckpt.shape(weight)) == shape
            and np.dtype(ckpt.dtype(weight)).kind in "fV"):
        return []
    return [f"{quantized.folder.name}: quantized linear {module} is missing (no {module}.weight "
            f"in any shard, quantized or float)"]


def _quantized_linear_problems(quantized, module: str, shape: tuple[int, ...]) -> list[str]:
    """A quantized linear: every tensor its layout needs, with the layout's dtype and shape, and a QArray of
    the reference weight's shape."""
    ckpt, layout, problems = quantized.checkpoint, quantized.layout, []
    where = ckpt.file_of([n for n in ckpt.tensor_names if n.startswith(module + ".")][0]).name
    for spec in layout.tensor_specs(module, shape, np.float32, quantized.flags):
        if spec.name not in ckpt:
            problems.append(f"{where}: tensor {spec.name} is missing (quantized linear {module} needs it)")
            continue
        got_shape, got_dtype = tuple(ckpt.shape(spec.name)), np.dtype(ckpt.dtype(spec.name))
        float_scale = spec.name.endswith(".weight_scale") and got_dtype.kind in "fV"
        if got_dtype != spec.dtype and not float_scale:
            problems.append(f"{ckpt.file_of(spec.name).name}: tensor {spec.name} is {got_dtype}, "
                            f"the {quantized.scheme} layout needs {spec.dtype}")
        if got_shape != spec.shape and not spec.name.endswith(layout.content_sized_suffixes):
            problems.append(f"{ckpt.file_of(spec.name).name}: tensor {spec.name} has shape "
                            f"{list(got_shape)}, expected {list(spec.shape)} for a {list(shape)} weight")
    try:
        q = quantized.qarray(module)
        if tuple(q.shape) != shape:
            problems.append(f"{where}: {module} decodes to shape {list(q.shape)}, the reference "
                            f"weight is {list(shape)}")
    except FormatError as exc:
        problems.append(str(exc))
    return problems


def _other_tensor_problems(quantized, reference, config: dict[str, Any], ref_linears: list[str],
                           float_names: set[str]) -> list[str]:
    """Every reference tensor that is no linear's weight: present in the folder with the reference's shape."""
    ckpt, problems = quantized.checkpoint, []
    linear_tensors = {f"{m}.weight" for m in ref_linears}
    # A tied lm_head the reference also stores is the embedding table: the conversion does not write it again.
    if config.get("tie_word_embeddings") is True and "lm_head" not in quantized.quantized_modules:
        linear_tensors.add("lm_head.weight")
    for name in reference.tensor_names:
        if name in linear_tensors:
            continue
        if name not in float_names:
            problems.append(f"{quantized.folder.name}: tensor {name} is missing (the reference has it)")
        elif tuple(ckpt.shape(name)) != tuple(reference.shape(name)):
            problems.append(f"{ckpt.file_of(name).name}: tensor {name} has shape {list(ckpt.shape(name))}, "
                            f"the reference has {list(reference.shape(name))}")
    return problems
