"""Every Pallas kernel lowers for the real TPU (Mosaic) and GPU (Triton) compilers, here on CPU.

Interpret mode accepts tiles and ops that the TPU compiler rejects, so this
checks the real lowering path of each kernel at realistic tilings and dtypes.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import mlir_verify

from qconvert.kernels import gpu_dense, tpu_dense, tpu_grouped
from qconvert.kernels.tiles import Tiling

S = jax.ShapeDtypeStruct
I32 = jnp.int32


def lowered_text(fn, args, platform, **static):
    return jax.jit(functools.partial(fn, **static)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_int8_matmul_lowers_for_tpu_and_gpu(out_dtype):
    args = (S((64, 1024), jnp.int8), S((512, 1024), jnp.int8), S((64, 1), jnp.float32), S((1, 512), jnp.float32),
            S((1, 512), jnp.float32))
    static = dict(out_dtype=out_dtype, has_bias=True, interpret=False)
    assert "tpu_custom_call" in lowered_text(tpu_dense.int8_matmul_tpu, args, "tpu", tiling=Tiling(64, 512, 256),
                                             **static)
    assert "triton" in lowered_text(gpu_dense.int8_matmul_gpu, args, "cuda", tiling=Tiling(64, 128, 64), **static)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_matmul_lowers_for_tpu_and_gpu(out_dtype):
    f8 = jnp.float8_e4m3fn
    args = (S((64, 1024), f8), S((512, 1024), f8), S((64, 1), jnp.float32), S((1, 512), jnp.float32),
            S((1, 512), jnp.float32))
    static = dict(out_dtype=out_dtype, has_bias=True, interpret=False)
    assert "tpu_custom_call" in lowered_text(tpu_dense.fp8_matmul_tpu, args, "tpu", tiling=Tiling(64, 512, 256),
                                             **static)
    # Mosaic: the E4M3 tiles are widened to bf16 (exact) and the MXU multiplies bf16
    mosaic = str(mlir_verify.last_module["mosaic"])
    assert "xf8E4M3FN> to vector<64x512xbf16>" in mosaic and "tpu.matmul" in mosaic
    assert "triton" in lowered_text(gpu_dense.fp8_matmul_gpu, args, "cuda", tiling=Tiling(64, 128, 64), **static)
    # Triton: the dot takes the E4M3 operands as they are (the native fp8 MMA) and accumulates in float32
    (dot,) = [line for line in str(mlir_verify.last_module["triton"]).splitlines() if "tt.dot" in line]
    assert "tensor<64x128xf8E4M3FN> * tensor<128x64xf8E4M3FN> -> tensor<64x64xf32>" in dot


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_w8a16_and_nf4_lower_for_tpu_and_gpu(x_dtype):
    static = dict(out_dtype=jnp.bfloat16, has_bias=False, interpret=False)
    w8 = (S((16, 1024), x_dtype), S((512, 1024), jnp.int8), S((1, 512), jnp.float32), S((1, 512), jnp.float32))
    assert "tpu_custom_call" in lowered_text(tpu_dense.int8_weight_matmul_tpu, w8, "tpu",
                                             tiling=Tiling(16, 512, 256), **static)
    assert "triton" in lowered_text(gpu_dense.int8_weight_matmul_gpu, w8, "cuda", tiling=Tiling(16, 64, 32), **static)
    nf4 = (S((16, 2048), x_dtype), S((16, 2048), x_dtype), S((512, 2048), jnp.uint8), S((512, 64), jnp.float32),
           S((1, 512), jnp.float32))
    assert "tpu_custom_call" in lowered_text(tpu_dense.nf4_matmul_tpu, nf4, "tpu", tiling=Tiling(16, 4096, 256),
                                             **static)
    assert "triton" in lowered_text(gpu_dense.nf4_matmul_gpu, nf4, "cuda", tiling=Tiling(16, 64, 32), **static)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("groups_per_tile", [16, 1])  # groups of 32 in a K tile of 512, or one scale per channel
def test_int4_lowers_for_tpu_and_gpu(x_dtype, groups_per_tile):
    static = dict(out_dtype=jnp.bfloat16, has_bias=True, interpret=False)
    # TPU: K 2048 in tiles of 512 (four K tiles of scales); GPU: the K row's scales, 64 of 32 or one per step
    tpu = (S((16, 1024), x_dtype), S((16, 1024), x_dtype), S((512, 1024), jnp.int8),
           S((4, 512, groups_per_tile), jnp.float32), S((1, 512), jnp.float32))
    assert "tpu_custom_call" in lowered_text(tpu_dense.int4_weight_matmul_tpu, tpu, "tpu",
                                             tiling=Tiling(16, 512, 256), **static)
    gpu = tpu[:3] + (S((512, 64 if groups_per_tile > 1 else 8), jnp.float32), tpu[4])
    assert "triton" in lowered_text(gpu_dense.int4_weight_matmul_gpu, gpu, "cuda", tiling=Tiling(16, 256, 32),
                                    **static)


@pytest.mark.parametrize("rhs_kind,transpose_rhs", [("float", False), ("float", True), ("int8", True),
                                                    ("fp8", True), ("nf4", True), ("int4", True)])
def test_grouped_matmul_lowers_for_tpu(rhs_kind, transpose_rhs):
    metadata = (S((5,), I32), S((12,), I32), S((12,), I32))
    if rhs_kind == "nf4":
        lhs = (S((256, 256), jnp.bfloat16),) * 2
        rhs = (S((4, 256, 256), jnp.uint8), S((4, 256, 8), jnp.float32))
    elif rhs_kind == "int4":  # K 512 in one tile, groups of 64
        lhs = (S((256, 256), jnp.bfloat16),) * 2
        rhs = (S((4, 256, 256), jnp.int8), S((4, 1, 256, 8), jnp.float32))
    else:
        lhs = (S((256, 512), jnp.bfloat16),)
        dtype = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(rhs_kind, jnp.bfloat16)
        rhs = (S((4, 256, 512) if transpose_rhs else (4, 512, 256), dtype),)
        if rhs_kind in ("int8", "fp8"):
            rhs += (S((4, 1, 256), jnp.float32),)
    text = lowered_text(tpu_grouped.grouped_matmul_tpu, (metadata, S((1,), I32), S((1,), I32), lhs, rhs), "tpu",
                        tiling=Tiling(128, 512, 256), out_dtype=jnp.bfloat16, rhs_kind=rhs_kind,
                        transpose_rhs=transpose_rhs, interpret=False)
    assert "tpu_custom_call" in text


def test_transposed_grouped_matmul_lowers_for_tpu():
    metadata = (S((5,), I32), S((12,), I32), S((12,), I32))
    text = lowered_text(tpu_grouped.transposed_grouped_matmul_tpu,
                        (metadata, S((1,), I32), S((1,), I32), S((512, 256), jnp.bfloat16), S((256, 256), jnp.bfloat16)),
                        "tpu", tiling=Tiling(128, 256, 256), out_dtype=jnp.float32, num_local=4, interpret=False)
    assert "tpu_custom_call" in text
