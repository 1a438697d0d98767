"""The verifier hook itself: a Triton module that a GPU would refuse fails its CPU lowering here."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr
from jaxlib.mlir import ir

import mlir_verify


def _select_bounded_loop(n_ref, x_ref, o_ref, *, skip_empty_with_select):
    n = n_ref[0]
    if skip_empty_with_select:
        # A select of Python ints as a loop bound: the shape that lowers to an i1 upper
        # bound beside i32 lower bound and step, which 'scf.for' refuses.
        bound = jnp.where(n > 0, 4, 0)
    else:
        bound = jnp.int32(4) * (n > 0).astype(jnp.int32)
    o_ref[...] = jax.lax.fori_loop(0, bound, lambda i, acc: acc + x_ref[...], jnp.zeros_like(o_ref))


def lower_for_cuda(skip_empty_with_select: bool) -> str:
    kernel = functools.partial(_select_bounded_loop, skip_empty_with_select=skip_empty_with_select)
    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                          in_specs=[pl.BlockSpec((1,), lambda: (0,)), pl.BlockSpec((16, 16), lambda: (0, 0))],
                          out_specs=pl.BlockSpec((16, 16), lambda: (0, 0)),
                          compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1))
    args = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16, 16), jnp.float32))
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_a_loop_bound_the_gpu_refuses_fails_the_cpu_lowering():
    with pytest.raises(ir.MLIRError, match="scf.for"):
        lower_for_cuda(skip_empty_with_select=True)


def test_the_int32_bound_is_accepted_and_verified():
    before = mlir_verify.verified["triton"]
    assert "triton" in lower_for_cuda(skip_empty_with_select=False)
    assert mlir_verify.verified["triton"] == before + 1
