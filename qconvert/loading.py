"""Load a converted folder as JAX parameters, quantized weights kept packed as QArrays.

    import json, qconvert
    from qconvert import models, ops
    params = qconvert.load(OUT)                       # nested dict of jax.Array / QArray
    flat = qconvert.flatten_params(params)
    model = models.build(qconvert.load_config(OUT), flat)      # the tensor names: where the model lies
    logits = model.forward(flat, input_ids, linear=ops.linear)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import jax
import jax.numpy as jnp

from qconvert.formats.errors import FormatError, InvalidCheckpointError, require_converted_folder
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


def load(folder) -> Params:
    """A converted folder as a nested dict of jax.Array and QArray leaves (weights stay packed).

    The nesting follows the dotted tensor names ("model" -> "layers" -> "0" ->
    ...). The dict is a pytree (QArray is registered), so it passes to jax.jit;
    `flatten_params` gives the flat form the qconvert.models forwards take.
    """
    return unflatten_params(load_flat(folder))


def load_config(folder) -> dict[str, Any]:
    """The folder's config.json (what qconvert.models.build takes)."""
    require_converted_folder(folder)
    return read_config(folder, missing="pass the output folder of `qconvert quantize`",
                       broken="re-run `qconvert quantize` to rewrite it")
