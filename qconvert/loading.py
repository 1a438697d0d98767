"""Load a converted folder as JAX parameters, quantized weights kept packed as QArrays (or prepared once).

    import json, qconvert
    from qconvert import models, ops
    params = qconvert.load(OUT)                       # nested dict of jax.Array / QArray
    flat = qconvert.flatten_params(params)
    model = models.build(qconvert.load_config(OUT), flat)      # the tensor names: where the model lies
    logits = model.forward(flat, input_ids, linear=ops.linear)

To serve, `qconvert.load(OUT, prepare=True)` (or `qconvert.prepare_params(params)`
on a tree already loaded) lays each dense quantized weight out for its kernel
once (kernels.prepared.prepare_weight: int4 codes packed two a byte, scales and
zero point placed), so `ops.linear` runs the kernel on it as it is instead of
repacking per matmul. Prepared weights are inference-only (a gradient through
them raises ops.PreparedWeightError); training and ops.ste take the default
QArrays. Left as QArrays: expert weights (".experts." in the name; the grouped
path stacks QArrays), fp8 weights (ops multiply their activation unquantized,
while the fp8 kernel quantizes it to E4M3 first), and any weight
prepare_weight takes no operand for (e.g. NF4 with in-features not a multiple
of 64, an int8 weight with a zero point): ops run those as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import jax
import jax.numpy as jnp

from qconvert.formats.errors import FormatError, InvalidCheckpointError, UsageError, require_converted_folder
from qconvert.formats.jsonfile import read_config
from qconvert.formats.layouts import open_quantized
from qconvert.formats.qarray import QArray

Params = dict[str, Union["Params", jax.Array, QArray]]


def _device_qarray(q: QArray) -> QArray:
    zero_point = None if q.zero_point is None else jnp.asarray(q.zero_point)
    return QArray(jnp.asarray(q.qvalue), jnp.asarray(q.scale), zero_point, kind=q.kind,
                  block_size=q.block_size, shape=q.shape, dtype=q.dtype)


def _open(folder: Path):
    require_converted_folder(folder)
    try:
        return open_quantized(folder)
    except FormatError as err:
        raise InvalidCheckpointError(f"{err}; re-run `qconvert quantize` to rewrite it") from None


def load_flat(folder) -> dict[str, jax.Array | QArray]:
    """The parameters of a converted folder keyed by checkpoint tensor name.

    Each quantized linear appears once, as "<module>.weight" -> QArray (packed
    int8 codes or NF4 nibbles with their scales, never a float copy), plus
    "<module>.input_scale" -> float32 [1] where a static activation scale is
    stored; every other tensor is a jax.Array as stored.
    """
    ckpt = _open(Path(folder))
    try:
        flat: dict[str, jax.Array | QArray] = {}
        for name in ckpt.float_names:
            flat[name] = jnp.asarray(ckpt.get(name))
        for module in ckpt.quantized_modules:
            flat[f"{module}.weight"] = _device_qarray(ckpt.qarray(module))
            input_scale = ckpt.input_scale(module)
            if input_scale is not None:
                flat[f"{module}.input_scale"] = jnp.asarray([input_scale], jnp.float32)
        return dict(sorted(flat.items()))
    except FormatError as err:
        raise InvalidCheckpointError(f"{err}; re-run `qconvert quantize` to rewrite it") from None
    finally:
        ckpt.close()


def unflatten_params(flat: Mapping[str, Any]) -> Params:
    """Dotted names to nested dicts: {"a.b.weight": w} -> {"a": {"b": {"weight": w}}}."""
    nested: dict[str, Any] = {}
    for name, leaf in flat.items():
        *path, last = name.split(".")
        node = nested
        for key in path:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensor name {name!r} runs through another tensor's name")
        if last in node:
            raise ValueError(f"tensor name {name!r} is also the prefix of other tensor names")
        node[last] = leaf
    return nested


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts back to dotted checkpoint names (the Mapping qconvert.models forwards read)."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, name + "."))
        else:
            flat[name] = value
    return flat


def _prepared_leaf(name: str, leaf: Any) -> Any:
    """The prepared kernel operand of one quantized dense weight, or the leaf as it is (see the module doc)."""
    from qconvert.kernels import KernelArgumentError  # the kernels load only when asked to prepare
    from qconvert.kernels.prepared import prepare_weight

    if not isinstance(leaf, QArray) or len(leaf.shape) != 2 or leaf.kind.float_codes or ".experts." in name:
        return leaf
    try:
        return prepare_weight(leaf)
    except KernelArgumentError:  # no prepared operand for this layout: ops keeps the QArray path
        return leaf


def prepare_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """params (nested as `load` gives them, or flat by dotted name) with every dense quantized weight
    prepared once for its kernel (a kernels.prepared.PreparedWeight leaf, a pytree that passes through
    jax.jit); every other leaf as it is. Inference only: see the module doc."""
    def walk(node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        return {key: walk(value, f"{prefix}{key}.") if isinstance(value, Mapping)
                else _prepared_leaf(f"{prefix}{key}", value) for key, value in node.items()}

    return walk(params, "")


def load(folder, prepare: bool = False) -> Params:
    """A converted folder as a nested dict of jax.Array and QArray leaves (weights stay packed).

    The nesting follows the dotted tensor names ("model" -> "layers" -> "0" ->
    ...). The dict is a pytree (QArray is registered), so it passes to jax.jit;
    `flatten_params` gives the flat form the qconvert.models forwards take.
    prepare=True (for serving) gives each dense quantized weight as its
    prepared kernel operand instead, made once here (`prepare_params`).
    """
    if not isinstance(prepare, bool):
        raise UsageError(f"qconvert.load: prepare must be True or False, got {prepare!r}")
    params = unflatten_params(load_flat(folder))
    return prepare_params(params) if prepare else params


def load_config(folder) -> dict[str, Any]:
    """The folder's config.json (what qconvert.models.build takes)."""
    require_converted_folder(folder)
    return read_config(folder, missing="pass the output folder of `qconvert quantize`",
                       broken="re-run `qconvert quantize` to rewrite it")
