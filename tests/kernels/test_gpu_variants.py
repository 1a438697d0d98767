"""The GPU kernel variants (split-K, swap-AB, GEMV, pipelined prefill, XLA's dot) on prepared weight operands:
bodies run in Pallas' generic interpreter against float64 products at real K, every variant and format
lowered for CUDA through MLIR's verifier, and the tuned table's choice of a variant per shape."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qconvert.formats import NF4_LEVELS, QArray
from qconvert.kernels import (KernelArgumentError, KernelProblem, int8_weight_matmul, qlinear, select_kernel)
from qconvert.kernels import gpu_decode, gpu_prefill, gpu_tuning, plan as plan_module, prepared
from qconvert.kernels.gpu_tuning import Variant
from qconvert.kernels.tiles import Tiling, int4_nibbles

import mlir_verify

RNG = np.random.default_rng(5)
VARIANTS = {"splitk": Variant("splitk", split=4), "swapab": Variant("swapab", split=2), "gemv": Variant("gemv"),
            "pipelined": Variant("pipelined", num_warps=8, num_stages=4), "tiled": Variant("tiled"),
            "xla": Variant("xla")}


@pytest.fixture
def variants_interpreted(monkeypatch, triton_interpreted):
    """The variant launchers (and, through triton_interpreted, gpu_dense's) in Pallas' generic interpreter."""
    for module, name in ((gpu_decode, "split_partials"), (gpu_prefill, "pipelined_matmul")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, functools.wraps(kernel)(
            lambda *a, _k=kernel, **kw: _k(*a, **{**kw, "interpret": True})))
    yield


def weights(fmt: str, n: int, k: int, zero: bool = False):
    """(prepared weight, its float64 [N, K] value, act) of a random weight in format fmt, decoded by hand."""
    if fmt in ("int8", "w8a16", "fp8"):
        scale = RNG.uniform(1e-3, 1e-2, n).astype(np.float32)
        if fmt == "fp8":
            codes = jnp.asarray(RNG.normal(size=(n, k)).astype(np.float32) * 40).astype(jnp.float8_e4m3fn)
        else:
            codes = jnp.asarray(RNG.integers(-127, 128, (n, k)).astype(np.int8))
        value = np.asarray(codes.astype(jnp.float32), np.float64) * scale[:, None]
        act = None if fmt == "w8a16" else "dynamic"
        return prepared.channel_weight("fp8" if fmt == "fp8" else "int8", codes, scale), value, act
    if fmt == "nf4":
        codes = RNG.integers(0, 16, (n, k))
        absmax = RNG.uniform(0.1, 1.0, (n, k // 64)).astype(np.float32)
        packed = ((codes[:, 0::2] << 4) | codes[:, 1::2]).astype(np.uint8)
        value = np.asarray(NF4_LEVELS, np.float64)[codes] * np.repeat(absmax, 64, axis=1)
        return prepared.nf4_weight(packed, absmax, n, k), value, None
    codes = RNG.integers(-8, 8, (n, k)).astype(np.int8)
    scale = RNG.uniform(1e-2, 2e-2, (n, k // 128)).astype(np.float32)
    zeros = RNG.integers(-3, 4, (n, k // 128)).astype(np.float32) if zero else np.zeros_like(scale)
    value = (codes - np.repeat(zeros, 128, axis=1)) * np.repeat(scale, 128, axis=1).astype(np.float64)
    return prepared.prepare_int4(codes, scale, 128, zeros if zero else None), value, None


def check(fmt, m, k, n, variant, tiling, zero=False):
    w, value, act = weights(fmt, n, k, zero)
    x = jnp.asarray(RNG.normal(size=(m, k)).astype(np.float32))
    y, plan = prepared.prepared_matmul(x, w, act=act, backend="gpu", variant=variant, tiling=tiling,
                                       return_plan=True)
    assert plan.variant == variant and plan.backend == "gpu"
    if act is None:
        want = np.asarray(x, np.float64) @ value.T
    else:
        # W8A8: x quantized per token exactly as the kernels do, then the float64 product of the codes' values
        quantize = {"int8": qconvert_int8, "fp8": qconvert_fp8}[fmt]
        want = quantize(x) @ value.T
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def qconvert_int8(x):
    from qconvert.kernels import quantize_activations
    q, s = quantize_activations(x)
    return np.asarray(q, np.float64) * np.asarray(s, np.float64).reshape(-1, 1)


def qconvert_fp8(x):
    from qconvert.kernels import quantize_fp8_activations
    q, s = quantize_fp8_activations(x)
    return np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64).reshape(-1, 1)


# Every Triton variant at Llama's real K (4096), each format at least once; small M and N keep interpret mode fast.
REAL_K = [("w8a16", "splitk"), ("int4", "swapab"), ("nf4", "gemv"), ("int8", "pipelined"), ("fp8", "splitk"),
          ("nf4", "pipelined"), ("int4", "tiled")]


@pytest.mark.parametrize("fmt,variant", REAL_K)
def test_variant_at_real_k_matches_float64(variants_interpreted, fmt, variant):
    check(fmt, 3, 4096, 32, VARIANTS[variant], Tiling(16, 256, 32))


def test_int4_zero_point_in_every_kernel_variant(variants_interpreted):
    for name in ("splitk", "swapab", "gemv", "pipelined", "xla", "tiled"):
        check("int4", 5, 512, 32, VARIANTS[name], Tiling(16, 128, 32), zero=True)
    # the tiled kernel (no variant chosen) takes the zero point too: no other variant is swapped in for it
    w, value, _ = weights("int4", 32, 512, zero=True)
    x = jnp.asarray(RNG.normal(size=(2, 512)).astype(np.float32))
    y, plan = prepared.prepared_matmul(x, w, backend="gpu", tiling=Tiling(16, 128, 32), return_plan=True)
    assert plan.variant is None and plan.fallback_reason is None
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ value.T, rtol=2e-5, atol=1e-4)


def test_int4_per_channel_scale_in_every_variant(variants_interpreted):
    # one scale (and zero point) per output channel: group_size None, every K step reads the same column
    codes = RNG.integers(-8, 8, (32, 512)).astype(np.int8)
    scale = RNG.uniform(1e-2, 2e-2, (32, 1)).astype(np.float32)
    zero = RNG.integers(-3, 4, (32, 1)).astype(np.float32)
    x = jnp.asarray(RNG.normal(size=(3, 512)).astype(np.float32))
    for with_zero in (False, True):
        w = prepared.prepare_int4(codes, scale.reshape(-1), None, zero if with_zero else None)
        value = (codes - (zero if with_zero else 0)) * scale.astype(np.float64)
        names = ("gemv", "pipelined", "xla", "tiled") if with_zero else ("splitk", "tiled")
        for name in names:
            y = prepared.prepared_matmul(x, w, backend="gpu", variant=VARIANTS[name], tiling=Tiling(16, 128, 32))
            np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ value.T, rtol=2e-5,
                                       atol=1e-4, err_msg=name)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "w8a16", "nf4", "int4"])
def test_every_variant_lowers_for_cuda_through_the_verifier(fmt):
    w, _, act = weights(fmt, 256, 1024, zero=fmt == "int4")
    x = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)  # Llama-sized lowering: real operands, real tiles
    before = mlir_verify.verified["triton"]
    for name, variant in VARIANTS.items():
        if name == "xla":
            continue  # XLA's dot is no Triton module
        tiling = Tiling(64 if name == "pipelined" else 16, 256, 64)
        fn = jax.jit(lambda x, w: prepared.prepared_matmul(x, w, act=act, backend="gpu", variant=variant,
                                                           tiling=tiling))
        assert "triton" in fn.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert mlir_verify.verified["triton"] - before == len(VARIANTS) - 1


def test_prepared_operand_is_the_qarray_contract_bit_for_bit():
    # backend "xla" runs reference.py's functions: the prepared operand (codes packed once) must give the
    # very bits the QArray route gives, for every kind.
    x = jnp.asarray(RNG.normal(size=(4, 256)).astype(np.float32)).astype(jnp.bfloat16)
    int4 = QArray(jnp.asarray(RNG.integers(-8, 8, (16, 256)).astype(np.int8)),
                  jnp.asarray(RNG.uniform(0.01, 0.02, (16, 2)).astype(np.float32)), kind="int4", block_size=128,
                  shape=(16, 256), dtype=jnp.bfloat16)
    int8 = QArray(jnp.asarray(RNG.integers(-127, 128, (16, 256)).astype(np.int8)),
                  jnp.asarray(RNG.uniform(0.01, 0.02, (16, 1)).astype(np.float32)), kind="int8", shape=(16, 256),
                  dtype=jnp.bfloat16)
    for q, act in ((int4, None), (int4, "dynamic"), (int8, None), (int8, "dynamic")):  # int4 dynamic: W4A8-FP8
        w = prepared.prepare_weight(q)
        assert w.w.shape == ((16, 128) if q is int4 else (16, 256))
        want = qlinear(x, q, act=act, backend="xla")
        got, plan = qlinear(x, w, act=act, backend="xla", return_plan=True)
        assert plan.backend == "xla"
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_prepared_int4_and_nf4_on_the_tpu_kernels_in_interpret_mode():
    x = jnp.asarray(RNG.normal(size=(8, 512)).astype(np.float32))
    for fmt, name in (("int4", "int4_weight_matmul_mosaic"), ("nf4", "nf4_matmul_mosaic")):
        w, value, _ = weights(fmt, 128, 512)
        y, plan = qlinear(x, w, backend="cpu", return_plan=True)
        assert plan.name == name and plan.interpret
        np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ value.T, rtol=1e-5,
                                   atol=1e-4)
    # an int4 zero point is one more Mosaic operand, laid out as the scales are; it also lowers for TPU
    w, value, _ = weights("int4", 128, 512, zero=True)
    y, plan = qlinear(x, w, backend="cpu", return_plan=True)
    assert plan.name == "int4_weight_matmul_mosaic" and plan.fallback_reason is None
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ value.T, rtol=1e-5, atol=1e-4)
    tpu = jax.jit(lambda x, w: qlinear(x, w, backend="tpu"))
    assert "tpu_custom_call" in tpu.trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
    # ... and the reference (the contract) takes it as well
    y = qlinear(x, w, backend="reference")
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ value.T, rtol=1e-5, atol=1e-4)


def test_bad_prepared_inputs_are_refused_by_name():
    with pytest.raises(KernelArgumentError, match="K=100 must be even and a multiple of the group size 64"):
        prepared.prepare_int4(np.zeros((4, 100), np.int8), np.ones((4, 1), np.float32), 64)
    w, _, _ = weights("nf4", 16, 128)
    with pytest.raises(KernelArgumentError, match="take float activations"):
        prepared.prepared_matmul(np.ones((2, 128), np.float32), w, act="dynamic")
    with pytest.raises(KernelArgumentError, match=r"x must be \[M, 128\]"):
        prepared.prepared_matmul(np.ones((2, 64), np.float32), w)
    with pytest.raises(KernelArgumentError, match=r"bias must be \[16\]"):
        prepared.prepared_matmul(np.ones((2, 128), np.float32), w, np.ones(15, np.float32))
    with pytest.raises(KernelArgumentError, match="act must be None, 'dynamic' or 'static'"):
        prepared.prepared_matmul(np.ones((2, 128), np.float32), w, act="per-token")
    with pytest.raises(KernelArgumentError, match="run on backend 'gpu'"):
        select_kernel(KernelProblem("nf4_matmul", 1, 128, 16), "cpu", variant=Variant("splitk"))
    with pytest.raises(KernelArgumentError, match="do not divide evenly"):
        select_kernel(KernelProblem("nf4_matmul", 1, 384, 16), "gpu", Tiling(16, 128, 16), Variant("splitk", split=2))
    with pytest.raises(ValueError, match="power of two"):
        Variant("splitk", split=3)


@pytest.fixture
def tuned_table(tmp_path, monkeypatch):
    path = tmp_path / "gpu_tuned.json"
    entries = [{"op": "int8_weight_matmul", "m": 1, "k": 512, "n": 64, "tiling": [16, 256, 32], "us": 1.0,
                "variant": Variant("splitk", split=2).as_json()},
               {"op": "int8_weight_matmul", "m": 64, "k": 512, "n": 64, "tiling": [64, 128, 64], "us": 2.0,
                "variant": Variant("pipelined").as_json()},
               {"op": "nf4_matmul", "m": 1, "k": 512, "n": 64, "tiling": [16, 96, 32], "us": 1.0,
                "variant": Variant("gemv").as_json()}]
    gpu_tuning.write_tuned(path, "test", entries)
    monkeypatch.setattr(gpu_tuning, "TUNED_PATH", path)
    plan_module._select_kernel.cache_clear()
    yield path
    plan_module._select_kernel.cache_clear()


def test_plans_take_the_tuned_variant_of_their_m_bucket(tuned_table, variants_interpreted):
    assert json.loads(tuned_table.read_text())["device"] == "test"
    plan = select_kernel(KernelProblem("int8_weight_matmul", 1, 512, 64), "gpu")
    assert (plan.variant, plan.tiling, plan.tile_table) == (Variant("splitk", split=2), Tiling(16, 256, 32),
                                                            "gpu/tuned")
    assert "variant splitk warps=4 stages=3 split=2" in plan.describe()
    # M = 20 takes the next bucket up (64), its row tile cut to hold M; past the last bucket, the last one
    plan = select_kernel(KernelProblem("int8_weight_matmul", 20, 512, 64), "gpu")
    assert (plan.variant.name, plan.tiling) == ("pipelined", Tiling(32, 128, 64))
    assert select_kernel(KernelProblem("int8_weight_matmul", 4096, 512, 64), "gpu").variant.name == "pipelined"
    # no entry for the shape, or an entry whose tiling breaks the rules (tk 96): the tile table's kernel
    assert select_kernel(KernelProblem("int8_weight_matmul", 1, 1024, 64), "gpu").variant is None
    assert select_kernel(KernelProblem("nf4_matmul", 1, 512, 64), "gpu").variant is None
    # the entry point runs the tuned variant, right against float64
    x = RNG.normal(size=(1, 512)).astype(np.float32)
    w_q = RNG.integers(-127, 128, (64, 512)).astype(np.int8)
    w_s = RNG.uniform(1e-3, 1e-2, 64).astype(np.float32)
    y, plan = int8_weight_matmul(jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(w_s), backend="gpu",
                                 return_plan=True)
    assert plan.variant.name == "splitk"
    want = x.astype(np.float64) @ (w_q.astype(np.float64) * w_s[:, None]).T
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5)


def test_no_tuned_file_means_the_tile_table(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_tuning, "TUNED_PATH", tmp_path / "absent.json")
    plan_module._select_kernel.cache_clear()
    try:
        plan = select_kernel(KernelProblem("nf4_matmul", 1, 4096, 4096), "gpu")
        assert (plan.variant, plan.tile_table) == (None, "gpu/decode")
    finally:
        plan_module._select_kernel.cache_clear()


OP_FORMATS = {"int8_matmul": ("int8", "dynamic"), "fp8_matmul": ("fp8", "dynamic"),
              "int8_weight_matmul": ("int8", None), "nf4_matmul": ("nf4", None), "int4_weight_matmul": ("int4", None)}


def abstract_weight(kind: str, n: int, k: int, group: int | None = 128) -> prepared.PreparedWeight:
    """A prepared weight of shapes only (for lowering): kind int8, fp8, nf4 or int4."""
    S = jax.ShapeDtypeStruct
    if kind in ("int8", "fp8"):
        dtype = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
        return prepared.PreparedWeight(kind, n, k, None, S((n, k), dtype), S((1, n), jnp.float32))
    columns = k // 64 if kind == "nf4" else k // group
    return prepared.PreparedWeight(kind, n, k, 64 if kind == "nf4" else group,
                                   S((n, k // 2), jnp.uint8 if kind == "nf4" else jnp.int8),
                                   S((n, columns), jnp.float32))


# A tuned table in bench/gpu_tune.py's format (every variant, every dense operation), for a checkout that no GPU has
# tuned: kernels/gpu_tuned.json is absent there, and its table empty.
SAMPLE_TUNED = Path(__file__).resolve().parents[1] / "gpu_tuned_sample.json"


def test_shipped_tuned_entries_lower_through_the_verifier():
    # Whatever a GPU run wrote into kernels/gpu_tuned.json lowers for CUDA; before one has run, the sample table.
    path = gpu_tuning.TUNED_PATH if gpu_tuning.TUNED_PATH.exists() else SAMPLE_TUNED
    table = gpu_tuning.load_tuned(str(path))
    entries = json.loads(path.read_text())["entries"]
    assert entries and sum(len(choices) for choices in table.values()) == len(entries), path
    before, triton = mlir_verify.verified["triton"], 0
    for key, choices in table.items():
        op, shape = key.split(" ")
        k, n = (int(v) for v in shape.split("x"))
        kind, act = OP_FORMATS[op]
        for m, variant, tiling in choices:
            fn = jax.jit(lambda x, w: prepared.prepared_matmul(x, w, act=act, backend="gpu", variant=variant,
                                                               tiling=tiling))
            text = fn.trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                            abstract_weight(kind, n, k)).lower(lowering_platforms=("cuda",)).as_text()
            if variant.name != "xla":  # XLA's dot is no Triton module
                assert "triton" in text, (key, m, str(variant))
                triton += 1
    assert triton and mlir_verify.verified["triton"] - before == triton


def grouped_rhs(kind: str, g: int, n: int, k: int):
    """(rhs for grouped_matmul, its float64 value [G, K, N] per expert, the rhs_scale) of a random kind."""
    if kind == "float":
        w = RNG.normal(size=(g, n, k)).astype(np.float32)
        return jnp.asarray(w), np.swapaxes(w.astype(np.float64), 1, 2), None
    if kind == "int8":
        codes, scale = RNG.integers(-127, 128, (g, n, k)).astype(np.int8), RNG.uniform(1e-3, 1e-2, (g, n))
        return jnp.asarray(codes), np.swapaxes(codes * scale[:, :, None], 1, 2), jnp.asarray(scale, jnp.float32)
    stacked, values = [], []
    for _ in range(g):
        w, value, _ = weights("nf4" if kind == "nf4" else "int4", n, k)
        values.append(value.T)
        stacked.append(w)
    if kind == "nf4":
        q = QArray(jnp.concatenate([w.w.reshape(-1) for w in stacked]),
                   jnp.concatenate([w.scale.reshape(-1) for w in stacked]), kind="nf4", block_size=64,
                   shape=(g, n, k), dtype=jnp.float32)
    else:
        codes = [np.asarray(jnp.stack(int4_nibbles(w.w.astype(jnp.int32)), -1).reshape(n, k))
                 for w in stacked]
        q = QArray(jnp.asarray(np.stack(codes).astype(np.int8)), jnp.stack([w.scale for w in stacked]),
                   kind="int4", block_size=128, shape=(g, n, k), dtype=jnp.float32)
    return q, np.stack(values), None



@pytest.mark.parametrize("kind", ["float", "int8", "nf4", "int4"])
def test_grouped_gemv_rows_times_their_experts(grouped_gemv_interpreted, kind):
    from qconvert.kernels import grouped_matmul
    from ops_helpers import numpy_grouped

    # 4 experts of a 6-expert layer (a shard from expert 1): expert 2 empty, rows 9-10 past every group
    sizes = np.array([2, 3, 0, 2, 2, 0], np.int32)
    rhs, values, scale = grouped_rhs(kind, 4, 32, 512)
    x = RNG.normal(size=(11, 512)).astype(np.float32)
    y, plan = grouped_matmul(jnp.asarray(x), rhs, jnp.asarray(sizes), transpose_rhs=True, rhs_scale=scale,
                             group_offset=1, backend="gpu", tiling=(16, 128, 32),
                             variant=Variant("gemv", split=2), return_plan=True)
    assert plan.variant.name == "gemv"
    want = numpy_grouped(x, list(values), sizes, offset=1)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert not np.asarray(y)[:2].any() and not np.asarray(y)[9:].any()  # rows of no local expert: exact zeros


def test_grouped_gemv_lowers_for_cuda_through_the_verifier():
    from qconvert.kernels import gpu_grouped_decode

    S = jax.ShapeDtypeStruct
    before = mlir_verify.verified["triton"]
    for fmt, w, scales in (("nf4", S((8, 768, 1024), jnp.uint8), S((8, 768, 32), jnp.float32)),
                           ("int4", S((8, 768, 1024), jnp.int8), S((8, 768, 16), jnp.float32)),
                           ("w8a16", S((8, 768, 2048), jnp.float8_e4m3fn), None)):
        parts = (S((16, 1024), jnp.bfloat16),) * 2 if fmt != "w8a16" else (S((16, 2048), jnp.bfloat16),)
        fn = functools.partial(gpu_grouped_decode.grouped_gemv_partials, fmt_name=fmt, tiling=Tiling(16, 256, 64),
                               split=4)
        jax.jit(fn).trace(S((16,), jnp.int32), parts, w, scales).lower(lowering_platforms=("cuda",))
    assert mlir_verify.verified["triton"] - before == 3


def test_verify_prepares_each_weight_once_on_a_gpu(variants_interpreted, monkeypatch):
    from qconvert.verify import kernel_path

    class Folder:  # what KernelPath reads of a converted folder: its scheme and activation mode
        scheme = "int4"
        flags = None

        class layout:
            @staticmethod
            def kernel_act(flags):
                return None

    calls = []
    monkeypatch.setattr(kernel_path, "prepare_weight", lambda q: calls.append(q) or prepared.prepare_weight(q))
    path = kernel_path.KernelPath(Folder(), backend="gpu")
    q = QArray(jnp.asarray(RNG.integers(-8, 8, (32, 256)).astype(np.int8)),
               jnp.asarray(RNG.uniform(0.01, 0.02, (32, 2)).astype(np.float32)), kind="int4", block_size=128,
               shape=(32, 256), dtype=jnp.float32)
    value = np.asarray(q.qvalue, np.float64) * np.repeat(np.asarray(q.scale, np.float64), 128, axis=1)
    for rows in (3, 5):  # two batches through one linear: one prepared operand
        x = RNG.normal(size=(rows, 256)).astype(np.float32)
        y, choice = path.linear("model.layers.0.mlp.up_proj", jnp.asarray(x), q, None)
        np.testing.assert_allclose(np.asarray(y, np.float64), x @ value.T, rtol=1e-5, atol=1e-4)
    assert len(calls) == 1 and choice.name == "int4_weight_matmul_triton" and choice.backend == "gpu"
