"""On-disk formats: QArray, packing, safetensors I/O and the export layouts."""

from qconvert.formats.qarray import NF4_LEVELS, QArray, dequantize, unpack_nf4_codes

__all__ = ["NF4_LEVELS", "QArray", "dequantize", "unpack_nf4_codes"]
