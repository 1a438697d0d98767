"""Quantized matmul kernels (Pallas, TPU and GPU), their pure-jnp references, and dispatch.

Rescale order of every kernel (fixed; the references define it):
  W8A8   acc_int32 -> float32, * x_scale[m], * w_scale[n], + bias[n], cast to out_dtype
  FP8    acc_f32 (E4M3 x E4M3 products, exact), * x_scale[m], * w_scale[n], + bias[n], cast
  W8A16  acc_f32 (x @ int8 codes cast to x's dtype), * w_scale[n], + bias[n], cast
  NF4    acc_f32 (x @ (level[code] * absmax[block] in f32, cast to x's dtype)), + bias[n], cast
  W4A16  acc_f32 (x @ (code * scale[n, group] in f32, cast to x's dtype)), + bias[n], cast
  FP4    acc_f32 (x @ (E2M1[code] * (scale[n, group] / global) in f32, cast to x's dtype)), + bias[n], cast
         (grouped FP4 experts alike, each expert over its own global scale)
  W4A8-FP8  x rounded to E4M3 per token (x_scale[m]), W4A16 on those values, * x_scale[m], + bias[n], cast
"""

from qconvert.kernels.activations import (fake_quantize_fp8_rows, fake_quantize_rows, quantize_activations,
                                          quantize_fp8_activations)
from qconvert.kernels.dense import fp8_matmul, int4_weight_matmul, int8_matmul, int8_weight_matmul, nf4_matmul
from qconvert.kernels.fp4 import fp4_weight_matmul
from qconvert.kernels.fp4_grouped import fp4_grouped_matmul
from qconvert.kernels.grouped import grouped_matmul, transposed_grouped_matmul
from qconvert.kernels.grouped_metadata import make_group_metadata
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.qlinear import qgrouped_linear, qlinear, stack_experts
from qconvert.kernels.backends import BACKENDS
from qconvert.kernels.plan import (GUARANTEES, KernelPlan, KernelProblem, resolve_backend,
                                   select_kernel)
from qconvert.kernels.reference import (fp4_grouped_matmul_reference, fp8_matmul_reference, grouped_matmul_reference,
                                        int4_dequantize_reference, int4_weight_matmul_reference, int8_matmul_reference,
                                        int8_weight_matmul_reference, nf4_dequantize_reference,
                                        nf4_matmul_reference, transposed_grouped_matmul_reference)
from qconvert.kernels.tiles import Tiling
from qconvert.kernels.gpu_tuning import Variant
from qconvert.kernels.prepared import PreparedWeight, prepare_weight, prepared_matmul
from qconvert.kernels.reference import w4a8_fp8_matmul_reference
from qconvert.kernels.w4a8 import w4a8_fp8_grouped_matmul, w4a8_fp8_matmul

__all__ = [
    "BACKENDS", "GUARANTEES", "KernelArgumentError", "KernelPlan", "KernelProblem", "PreparedWeight", "Tiling",
    "Variant", "prepare_weight", "prepared_matmul", "fake_quantize_fp8_rows",
    "fake_quantize_rows", "fp4_grouped_matmul", "fp4_grouped_matmul_reference", "fp4_weight_matmul", "fp8_matmul",
    "fp8_matmul_reference",
    "grouped_matmul", "grouped_matmul_reference", "int4_dequantize_reference", "int4_weight_matmul",
    "int4_weight_matmul_reference", "int8_matmul", "int8_matmul_reference", "int8_weight_matmul",
    "int8_weight_matmul_reference", "make_group_metadata", "nf4_dequantize_reference", "nf4_matmul", "nf4_matmul_reference",
    "qgrouped_linear", "qlinear", "quantize_activations", "quantize_fp8_activations", "resolve_backend", "select_kernel", "stack_experts",
    "transposed_grouped_matmul", "transposed_grouped_matmul_reference",
    "w4a8_fp8_grouped_matmul", "w4a8_fp8_matmul", "w4a8_fp8_matmul_reference",
]
