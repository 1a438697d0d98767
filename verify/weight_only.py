"""verify for a folder converted weight-only with --any-architecture: the checks that need no forward pass.

qconvert has no forward pass for such a decoder, so no real activations can be
captured. Each quantized linear still runs through its deployment kernel against
the float layer, on synthetic inputs (standard normal rows, a fixed seed): that
checks the stored codes, scales and layout of every linear at the same thresholds.
The whole-model stage is skipped, and the report says so; a skip is not a failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from qconvert.verify.fidelity import FolderLinear
from qconvert.verify.kernel_path import KernelPath
from qconvert.verify.layers import compare_linear
from qconvert.verify.results import LayerResult
from qconvert.verify.thresholds import Thresholds

SYNTHETIC_ROWS = 64
SYNTHETIC_SEED = 0


def synthetic_inputs(in_features: int, rows: int = SYNTHETIC_ROWS, seed: int = SYNTHETIC_SEED) -> np.ndarray:
    """float32 [rows, in_features] standard normal rows, the same on every run."""
    return np.random.default_rng(seed).standard_normal((rows, in_features)).astype(np.float32)


def verify_linears_on_synthetic_inputs(reference: Mapping, converted: Mapping, modules: Sequence[str],
                                       kernels: KernelPath, thresholds: Thresholds,
                                       rows: int = SYNTHETIC_ROWS, folder_linear: FolderLinear | None = None,
                                       ) -> list[LayerResult]:
    """Every quantized linear through its kernel against the float layer (quality) and, with
    `folder_linear`, against the folder's own dequantized layer (fidelity), on synthetic rows."""
    results = []
    for name in sorted(modules):
        in_features = int(np.shape(reference[f"{name}.weight"])[1])
        results.append(compare_linear(name, synthetic_inputs(in_features, rows), reference, converted,
                                      kernels, thresholds, folder_linear=folder_linear))
    return results


def skipped_stages(architecture: str, rows: int = SYNTHETIC_ROWS) -> tuple[str, ...]:
    """What a weight-only verify could not do, one line each."""
    return (
        f"captured activations: qconvert has no forward pass for {architecture}, so each quantized linear "
        f"ran on {rows} synthetic rows (standard normal, seed {SYNTHETIC_SEED}) instead",
        f"whole model: no forward pass for {architecture} (converted weight-only with --any-architecture)",
    )
