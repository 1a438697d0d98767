"""Run MLIR's verifier on every Triton and Mosaic module Pallas builds, as a real GPU or TPU compiler would.

A CPU-side `.lower(lowering_platforms=("cuda",))` hands XLA a Triton module that
only a GPU parses (and so verifies); a module the GPU would refuse ("'scf.for' op
failed to verify ...") still lowers here without a word. install() wraps the
Pallas lowerings for Triton and Mosaic so that every module is verified as it is
built, and a bad one raises MLIRError naming the kernel's source line. conftest
installs it for every test; `verified` counts the modules checked, per dialect.
"""

from __future__ import annotations

import collections

from jax._src.pallas.mosaic import lowering as mosaic_lowering
from jax._src.pallas.triton import lowering as triton_lowering

verified: collections.Counter = collections.Counter()
last_module: dict[str, object] = {}  # dialect -> the last module verified (its text shows what a kernel became)
_installed = False


def _verifying(lower, dialect: str, module_of):
    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        module = module_of(result)
        module.operation.verify()  # raises MLIRError, as the device compiler would refuse it
        verified[dialect] += 1
        last_module[dialect] = module
        return result

    lower_and_verify.__wrapped__ = lower
    return lower_and_verify


def install() -> None:
    """Wrap the Triton and Mosaic module builders (once per process) so each module is verified."""
    global _installed
    if _installed:
        return
    triton_lowering.lower_jaxpr_to_triton_module = _verifying(
        triton_lowering.lower_jaxpr_to_triton_module, "triton", lambda result: result.module)
    mosaic_lowering.lower_jaxpr_to_pipelined_module = _verifying(
        mosaic_lowering.lower_jaxpr_to_pipelined_module, "mosaic", lambda module: module)
    _installed = True
