"""On-disk formats: QArray, packing, safetensors I/O and the export layouts."""

from qconvert.formats.checkpoint_params import CheckpointParams
from qconvert.formats.errors import FormatError
from qconvert.formats.layouts import (
    LAYOUTS,
    SCHEMES,
    Layout,
    LayoutFlags,
    QuantizedCheckpoint,
    layout_for,
    layout_for_config,
    linear_tensor_specs,
    open_quantized,
    qarray_to_tensors,
    quantization_config,
)
from qconvert.formats.qarray import INT8_QMAX, NF4_BLOCK_SIZE, NF4_LEVELS, QArray, dequantize, unpack_nf4_codes
from qconvert.formats.safetensors_io import (
    SafetensorsCheckpoint,
    TensorSpec,
    open_checkpoint,
    sha256_file,
    write_shards,
)

__all__ = [
    "INT8_QMAX", "NF4_BLOCK_SIZE", "NF4_LEVELS", "QArray", "dequantize", "unpack_nf4_codes",
    "CheckpointParams", "FormatError",
    "SafetensorsCheckpoint", "TensorSpec", "open_checkpoint", "sha256_file", "write_shards",
    "LAYOUTS", "SCHEMES", "Layout", "LayoutFlags", "QuantizedCheckpoint", "layout_for",
    "layout_for_config", "linear_tensor_specs", "open_quantized",
    "qarray_to_tensors", "quantization_config",
]
