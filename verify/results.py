"""The records verify produces: which kernel ran, per-layer and whole-model results, the full report."""

from __future__ import annotations

import dataclasses
from typing import Any

from qconvert.verify.integrity import IntegrityResult
from qconvert.verify.metrics import TensorMetrics
from qconvert.verify.thresholds import Check, Thresholds


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel that computed a layer: its name, backend, tiling (and the tile table it came from,
    e.g. "gpu/decode"), and why it fell back, if it did."""

    name: str
    backend: str
    pallas: bool
    tiling: dict[str, Any] | None = None
    fallback_reason: str | None = None
    interpret: bool = False
    tile_table: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """One quantized linear through its deployment kernel, on the same inputs, against two references.

    `metrics`/`checks` (quality): against the float layer. `fidelity`/
    `fidelity_checks`: against the same layer computed from the folder's own
    dequantized weights (verify/fidelity.py), which only a wrong kernel fails.
    """

    name: str
    kernel: KernelChoice
    metrics: TensorMetrics
    tokens: int
    checks: tuple[Check, ...]
    fidelity: TensorMetrics | None = None
    fidelity_checks: tuple[Check, ...] = ()

    @property
    def quality_passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def fidelity_passed(self) -> bool:
        return all(c.passed for c in self.fidelity_checks)

    @property
    def passed(self) -> bool:
        return self.quality_passed and self.fidelity_passed

    def as_dict(self) -> dict[str, Any]:
        fidelity = {}
        if self.fidelity is not None:
            fidelity = {"fidelity_sqnr_db": self.fidelity.sqnr_db,
                        "fidelity_max_abs_error": self.fidelity.max_abs_error}
        return {"name": self.name, "passed": self.passed, "quality_passed": self.quality_passed,
                "fidelity_passed": self.fidelity_passed, "tokens": self.tokens,
                "kernel": self.kernel.as_dict(), **self.metrics.as_dict(), **fidelity,
                "checks": [c.as_dict() for c in self.checks + self.fidelity_checks]}


@dataclasses.dataclass(frozen=True)
class ModelResult:
    """The whole model with quantized linears through the kernels against the float model.

    `kind` is "causal_lm" (metrics: mean_kl, top1_agreement, perplexity_float,
    perplexity_quantized, perplexity_ratio) or "encoder" (pooled_cosine_mean,
    pooled_cosine_min).
    """

    kind: str
    sequences: int
    tokens: int
    metrics: dict[str, float]
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "passed": self.passed, "sequences": self.sequences,
                "tokens": self.tokens, **self.metrics, "checks": [c.as_dict() for c in self.checks]}


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Everything one `qconvert verify` run found; `passed` decides the exit code."""

    folder: str
    scheme: str
    reference: dict[str, Any]
    backend: str
    devices: tuple[str, ...]
    thresholds: Thresholds
    integrity: IntegrityResult
    layers: tuple[LayerResult, ...]
    model: ModelResult | None
    extra_checks: tuple[Check, ...]
    evaluation: dict[str, Any]
    versions: dict[str, str]
    seconds: float
    # Stages (or parts of them) that could not run, each one line saying why; not failures.
    skipped: tuple[str, ...] = ()
    # How the folder's weights were rounded, from its qconvert.json's `rounding` (its per-linear errors left
    # out): {"method": "gptq", "damp": ..., ...} or {"method": "rtn"} (also for folders that predate it).
    rounding: dict[str, Any] = dataclasses.field(default_factory=lambda: {"method": "rtn"})
    # The thresholds given on the command line in place of the scheme's (name -> value); {} for the defaults.
    thresholds_given: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def failed_fidelity_checks(self) -> list[Check]:
        """Kernel against the folder's own arithmetic: failures here are the kernel's."""
        return [c for layer in self.layers for c in layer.fidelity_checks if not c.passed]

    @property
    def failed_quality_checks(self) -> list[Check]:
        """Against the float model (per layer, then whole model): what the quantization costs."""
        checks = [c for layer in self.layers for c in layer.checks]
        checks += list(self.model.checks) if self.model else []
        return [c for c in checks if not c.passed]

    @property
    def failed_checks(self) -> list[Check]:
        return (self.failed_fidelity_checks + self.failed_quality_checks
                + [c for c in self.extra_checks if not c.passed])

    @property
    def fidelity_passed(self) -> bool:
        return self.integrity.passed and not self.failed_fidelity_checks

    @property
    def quality_passed(self) -> bool:
        return self.integrity.passed and not self.failed_quality_checks

    @property
    def passed(self) -> bool:
        return self.integrity.passed and not self.failed_checks
