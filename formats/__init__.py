"""On-disk formats: QArray, packing, safetensors I/O and the export layouts.

The names below are imported on first use (PEP 562), so that `qconvert.formats.errors`, which every layer and
the CLI's error paths import, starts no JAX: `qconvert --version`, `--help` and a refusal of bad flags stay fast.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "CheckpointParams": "checkpoint_params",
    "FormatError": "errors",
    **dict.fromkeys(("LAYOUTS", "SCHEMES", "Layout", "LayoutFlags", "QuantizedCheckpoint", "layout_for",
                     "layout_for_config", "linear_tensor_specs", "open_quantized", "qarray_to_tensors",
                     "quantization_config"), "layouts"),
    **dict.fromkeys(("INT8_QMAX", "NF4_BLOCK_SIZE", "NF4_LEVELS", "QArray", "dequantize", "unpack_nf4_codes"),
                    "qarray"),
    **dict.fromkeys(("SafetensorsCheckpoint", "TensorSpec", "open_checkpoint", "sha256_file", "write_shards"),
                    "safetensors_io"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'qconvert.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"qconvert.formats.{home}"), name)
    globals()[name] = value
    return value
