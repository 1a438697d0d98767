"""Per-scheme pass/fail thresholds for verify, and the Check record each comparison leaves.

The defaults are set so that a correct conversion passes with room to spare and a
broken one (a scale off by 2x, a wrong packing order, a dropped smoothing fold)
fails by a wide margin:

- int8 (weight-only, per output channel): rounding error of a per-row absmax/127
  grid is ~0.3% of a layer's output RMS, i.e. ~40-50 dB SQNR. Floor: 30 dB.
- w8a8 (int8 weights + per-token or per-tensor int8 activations): activation
  rounding adds noise where outlier channels stretch a token's range; smoothed
  layers sit near 30-40 dB, static per-tensor scales lower. Floor: 20 dB.
- nf4 (16 levels, absmax per 64): ~20-21 dB on Gaussian-like weights. Floor: 15 dB.

Static per-tensor activations (w8a8 --act static) get their own row: one scale
for every token of a linear's input costs more than per-token scales. Measured
on a real 135M-parameter Llama: a correct static conversion had its worst
down_proj at 19.1 dB, mean KL 0.073, perplexity x1.047; hence 15 dB, KL 0.15,
ppl 1.15.

Fidelity (the deployment kernel against the same layer computed in float64
from the folder's own dequantized weights, the activations quantized the same
way) does not depend on what the quantization costs, only on the kernel: the
int8 arithmetic is exact, what remains is float32 accumulation and rescaling
(>100 dB on CPU) or a TPU's bf16 matmul passes on float32 inputs (~60 dB).
A wrong kernel (a bad tile, a misdecoded nibble) lands under 30 dB. Floors:
60 dB int8 paths, 40 dB NF4 (its table values and absmax products round in
float32/bf16 before accumulating).

A scale off by 2x puts a layer at ~0 dB (error as large as the signal), far
under every floor. SQNR s dB means a relative Frobenius error of 10^(-s/20),
so the cosine floors are those the SQNR floors imply, rounded down.

Whole-model floors (causal LMs: next-token mean KL in nats, top-1 agreement,
perplexity ratio quantized/float; encoders: cosine of mean-pooled outputs, the
worst sequence) scale with the same per-scheme noise: layer errors add up over
depth. Measured on all-MiniLM-L6-v2 (36 linears, built-in text): pooled cosine
0.9995 int8, 0.997 w8a8 (smoothed, per-token), 0.966 nf4 (layers at 19.5-22.5
dB), hence floors of 0.998 / 0.98 / 0.95. Each default can be overridden by a
CLI flag.
"""

from __future__ import annotations

import dataclasses
import math

from qconvert.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What a converted folder must reach to pass."""

    min_layer_sqnr_db: float
    min_layer_cosine: float
    max_mean_kl: float
    min_top1_agreement: float
    max_perplexity_ratio: float
    min_pooled_cosine: float
    min_fidelity_sqnr_db: float = 60.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


DEFAULT_THRESHOLDS: dict[str, Thresholds] = {
    "int8": Thresholds(
        min_layer_sqnr_db=30.0, min_layer_cosine=0.999, max_mean_kl=0.01,
        min_top1_agreement=0.90, max_perplexity_ratio=1.02, min_pooled_cosine=0.998,
    ),
    "w8a8": Thresholds(
        min_layer_sqnr_db=20.0, min_layer_cosine=0.99, max_mean_kl=0.05,
        min_top1_agreement=0.80, max_perplexity_ratio=1.10, min_pooled_cosine=0.98,
    ),
    "nf4": Thresholds(
        min_layer_sqnr_db=15.0, min_layer_cosine=0.98, max_mean_kl=0.10,
        min_top1_agreement=0.70, max_perplexity_ratio=1.25, min_pooled_cosine=0.95,
        min_fidelity_sqnr_db=40.0,
    ),
}

# Per activation mode, where it differs from the scheme's row: w8a8 with static per-tensor scales.
STATIC_ACT_THRESHOLDS: dict[str, Thresholds] = {
    "w8a8": Thresholds(
        min_layer_sqnr_db=15.0, min_layer_cosine=0.98, max_mean_kl=0.15,
        min_top1_agreement=0.75, max_perplexity_ratio=1.15, min_pooled_cosine=0.95,
    ),
}


def thresholds_for(scheme: str, act: str = "dynamic", **overrides: float | None) -> Thresholds:
    """The default thresholds of `scheme` (and activation mode), with every non-None override applied."""
    if scheme not in DEFAULT_THRESHOLDS:
        raise UsageError(
            f"no verify thresholds for scheme {scheme!r}; known schemes: "
            + ", ".join(sorted(DEFAULT_THRESHOLDS))
        )
    fields = {f.name for f in dataclasses.fields(Thresholds)}
    unknown = set(overrides) - fields
    if unknown:
        raise UsageError(f"unknown threshold(s): {', '.join(sorted(unknown))}")
    given = {k: float(v) for k, v in overrides.items() if v is not None}
    for name, value in given.items():
        if math.isnan(value):
            raise UsageError(f"threshold {name} is NaN; give a number")
    base = STATIC_ACT_THRESHOLDS.get(scheme) if act == "static" else None
    return dataclasses.replace(base or DEFAULT_THRESHOLDS[scheme], **given)


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison of a measured value with its threshold.

    `bound` is "min" (value must be >= limit) or "max" (value must be <= limit).
    """

    name: str
    subject: str
    value: float
    limit: float
    bound: str
    passed: bool

    def describe(self) -> str:
        """e.g. 'model.layers.0.mlp.up_proj: sqnr_db 3.10 < 30.00'."""
        op = ">=" if self.bound == "min" else "<="
        if not self.passed:
            op = "<" if self.bound == "min" else ">"
        return f"{self.subject}: {self.name} {self.value:.4g} {op} {self.limit:.4g}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check(name: str, subject: str, value: float, limit: float, bound: str) -> Check:
    """Compare `value` with `limit`; NaN never passes."""
    if bound not in ("min", "max"):
        raise ValueError(f"bound must be 'min' or 'max', not {bound!r}")
    ok = value >= limit if bound == "min" else value <= limit
    return Check(name, subject, float(value), float(limit), bound, bool(ok and not math.isnan(value)))
