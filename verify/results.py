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
    """One quantized linear through its deployment kernel against the float layer on the same inputs."""

    name: str
    kernel: KernelChoice
    metrics: TensorMetrics
    tokens: int
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "tokens": self.tokens,
                "kernel": self.kernel.as_dict(), **self.metrics.as_dict(),
                "checks": [c.as_dict() for c in self.checks]}


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

    @property
    def failed_checks(self) -> list[Check]:
        checks = [c for layer in self.layers for c in layer.checks]
        checks += list(self.model.checks) if self.model else []
        return [c for c in checks + list(self.extra_checks) if not c.passed]

    @property
    def passed(self) -> bool:
        return self.integrity.passed and not self.failed_checks
