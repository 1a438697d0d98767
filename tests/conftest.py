"""Shared pytest setup: JAX on CPU, the Hub offline, the tiny checkpoint builders importable."""

import functools
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, str(Path(__file__).parent))

# Property tests draw the same examples on every run, so CI is reproducible; a
# failure found here is a failure everywhere.
from hypothesis import settings  # noqa: E402

settings.register_profile("qconvert", derandomize=True, database=None, print_blob=True)
settings.load_profile("qconvert")

# Every Triton and Mosaic module a test lowers is run through MLIR's verifier, as
# the GPU and TPU compilers would: a CPU lowering alone never reaches it.
import mlir_verify  # noqa: E402

mlir_verify.install()

import jax  # noqa: E402
import pytest  # noqa: E402


def _interpreted(kernel):
    @functools.wraps(kernel)
    def run(*args, **kwargs):
        return kernel(*args, **{**kwargs, "interpret": True})

    return run


@pytest.fixture
def triton_interpreted(monkeypatch):
    """Make backend "gpu" run the Triton kernel bodies in Pallas' generic interpreter (no GPU here).

    The entry points' jitted launches trace the kernel functions once per plan, so
    the compiled caches are cleared on both sides: no interpreted trace outlives
    the test, and no earlier real (lowering-only) trace is reused inside it.
    """
    from qconvert.kernels import gpu_dense, gpu_grouped

    jax.clear_caches()
    for module, names in ((gpu_dense, ("int8_matmul_gpu", "fp8_matmul_gpu", "int8_weight_matmul_gpu", "nf4_matmul_gpu",
                                       "int4_weight_matmul_gpu")),
                          (gpu_grouped, ("grouped_matmul_gpu", "transposed_grouped_matmul_gpu"))):
        for name in names:
            monkeypatch.setattr(module, name, _interpreted(getattr(module, name)))
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture
def grouped_gemv_interpreted(monkeypatch):
    """Make the Triton grouped GEMV decode variant run in Pallas' generic interpreter (caches cleared both sides)."""
    from qconvert.kernels import gpu_grouped_decode

    monkeypatch.setattr(gpu_grouped_decode, "grouped_gemv_partials",
                        _interpreted(gpu_grouped_decode.grouped_gemv_partials))
    jax.clear_caches()
    yield
    jax.clear_caches()
