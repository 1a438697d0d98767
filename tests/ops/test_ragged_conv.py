"""qconvert.ops.ragged_dot / ragged_dot_general / conv_general_dilated against jax.lax on dequantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import int8_qarray, int8_values

from qconvert import ops
from qconvert.ops.dispatch import DEQUANTIZE, INT8_INT32

HIGHEST = jax.lax.Precision.HIGHEST
RDN = jax.lax.RaggedDotDimensionNumbers


def _close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * (1 + np.abs(np.asarray(ref)).max()))


@pytest.mark.parametrize("quantized", ["lhs", "rhs", "both"])
def test_ragged_dot_with_per_group_scales_matches_lax(quantized):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 8)).astype(np.float32)
    w = rng.standard_normal((3, 8, 5)).astype(np.float32)
    group_sizes = jnp.array([4, 0, 3], jnp.int32)  # an empty group, and 2 rows in no group
    x_op = int8_qarray(x, shared_axes=(1,)) if quantized != "rhs" else x  # per token
    w_op = int8_qarray(w, shared_axes=(1,)) if quantized != "lhs" else w  # per expert and output channel
    ref = jax.lax.ragged_dot(int8_values(x_op) if quantized != "rhs" else x,
                             int8_values(w_op) if quantized != "lhs" else w, group_sizes, precision=HIGHEST)
    with ops.record_paths() as decisions:
        out = ops.ragged_dot(x_op, w_op, group_sizes, precision=HIGHEST)
    _close(out, ref)
    assert decisions[0].path == (INT8_INT32 if quantized == "both" else DEQUANTIZE)


def test_ragged_dot_fast_path_is_bit_exact_against_an_int32_reference():
    rng = np.random.default_rng(1)
    x = int8_qarray(rng.standard_normal((6, 8)), shared_axes=(1,))
    w = int8_qarray(rng.standard_normal((2, 8, 3)), shared_axes=(1,))
    sizes = [2, 4]
    out = ops.ragged_dot(x, w, jnp.array(sizes, jnp.int32))
    xq, wq = np.asarray(x.qvalue, np.int64), np.asarray(w.qvalue, np.int64)
    group_of_row = np.repeat(np.arange(2), sizes)
    acc = np.stack([xq[i] @ wq[g] for i, g in enumerate(group_of_row)]).astype(np.int32)
    row_scale = np.asarray(x.scale, np.float32)  # [6, 1]
    col_scale = np.asarray(w.scale, np.float32)[group_of_row, 0, :]  # [6, 3]
    np.testing.assert_array_equal(np.asarray(out), (acc.astype(np.float32) * row_scale) * col_scale)


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims,group_sizes",
    [
        # ragged non-contracting with a batch dim: [b, m, k] x [b, g, k, n]
        ((2, 6, 4), (2, 3, 4, 5), RDN((((2,), (2,)), ((0,), (0,))), [1], [1]), [1, 2, 3]),
        # ragged contracting: [m, k] x [k, n] -> [g, m, n]
        ((3, 7), (7, 4), RDN((((1,), (0,)), ((), ())), [1], []), [3, 4]),
        # ragged batch: [b, m, k] x [b, k, n]
        ((5, 2, 4), (5, 4, 3), RDN((((2,), (1,)), ((0,), (0,))), [0], []), [2, 3]),
    ],
)
def test_ragged_dot_general_modes_match_lax(lhs_shape, rhs_shape, dims, group_sizes):
    rng = np.random.default_rng(2)
    (lc, rc), _ = dims.dot_dimension_numbers
    lhs = int8_qarray(rng.standard_normal(lhs_shape), shared_axes=lc)
    rhs = int8_qarray(rng.standard_normal(rhs_shape), shared_axes=rc)
    gs = jnp.array(group_sizes, jnp.int32)
    ref = jax.lax.ragged_dot_general(int8_values(lhs), int8_values(rhs), gs, dims, precision=HIGHEST)
    with ops.record_paths() as decisions:
        out = ops.ragged_dot_general(lhs, rhs, gs, dims, precision=HIGHEST)
    _close(out, ref)
    assert decisions[0].path == INT8_INT32


@pytest.mark.parametrize(
    "dimension_numbers,lhs_shape,rhs_shape,groups",
    [
        (("NCHW", "OIHW", "NCHW"), (2, 3, 6, 6), (4, 3, 3, 3), 1),
        (("NHWC", "HWIO", "NHWC"), (2, 5, 5, 4), (3, 3, 2, 6), 2),
        (("NWC", "WIO", "NWC"), (1, 9, 2), (3, 2, 5), 1),
    ],
)
def test_conv_fast_path_matches_lax_on_dequantized_operands(dimension_numbers, lhs_shape, rhs_shape, groups):
    rng = np.random.default_rng(3)
    lhs_spec, rhs_spec, _ = dimension_numbers
    batch_axis, out_axis = lhs_spec.index("N"), rhs_spec.index("O")
    lhs = int8_qarray(rng.standard_normal(lhs_shape), shared_axes=tuple(a for a in range(len(lhs_shape)) if a != batch_axis))
    rhs = int8_qarray(rng.standard_normal(rhs_shape), shared_axes=tuple(a for a in range(len(rhs_shape)) if a != out_axis))
    strides = (1,) * (len(lhs_shape) - 2)
    kwargs = dict(window_strides=strides, padding="SAME", rhs_dilation=(2,) * len(strides),
                  dimension_numbers=dimension_numbers, feature_group_count=groups)
    ref = jax.lax.conv_general_dilated(int8_values(lhs), int8_values(rhs), precision=HIGHEST, **kwargs)
    with ops.record_paths() as decisions:
        out = ops.conv_general_dilated(lhs, rhs, precision=HIGHEST, **kwargs)
    _close(out, ref)
    assert decisions[0].path == INT8_INT32


def test_conv_with_a_per_element_input_scale_dequantizes():
    rng = np.random.default_rng(4)
    x = int8_qarray(rng.standard_normal((1, 2, 5, 5)))  # scale varies over channels and space
    k = int8_qarray(rng.standard_normal((3, 2, 3, 3)), shared_axes=(1, 2, 3))
    ref = jax.lax.conv_general_dilated(int8_values(x), int8_values(k), (2, 2), [(1, 1), (0, 2)], precision=HIGHEST)
    with ops.record_paths() as decisions:
        out = ops.conv_general_dilated(x, k, (2, 2), [(1, 1), (0, 2)], precision=HIGHEST)
    _close(out, ref)
    assert decisions[0].path == DEQUANTIZE and "lhs scale varies" in decisions[0].reason


@pytest.mark.parametrize("preferred", [None, jnp.float32])
def test_conv_output_dtype_follows_lax_for_bf16_operands(preferred):
    rng = np.random.default_rng(5)
    x = int8_qarray(rng.standard_normal((1, 2, 4, 4)), shared_axes=(1, 2, 3), dtype="bfloat16")
    k = int8_qarray(rng.standard_normal((3, 2, 3, 3)), shared_axes=(1, 2, 3), dtype="bfloat16")
    ref = jax.lax.conv_general_dilated(x.dequantize(), k.dequantize(), (1, 1), "VALID", preferred_element_type=preferred)
    out = ops.conv_general_dilated(x, k, (1, 1), "VALID", preferred_element_type=preferred)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=5e-2)


def test_conv_rejects_a_narrower_preferred_type_like_lax():
    x = int8_qarray(np.ones((1, 2, 4, 4)), shared_axes=(1, 2, 3))
    k = int8_qarray(np.ones((3, 2, 3, 3)), shared_axes=(1, 2, 3))
    with pytest.raises(TypeError, match="narrower"):
        ops.conv_general_dilated(x, k, (1, 1), "VALID", preferred_element_type=jnp.bfloat16)
