"""Shared pytest setup: JAX on CPU, the Hub offline, the tiny checkpoint builders importable."""

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
