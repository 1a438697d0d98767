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
- int4 (16 uniform levels, absmax / 7.5 per group of 128 input columns): ~20 dB
  on Gaussian-like weights, ~16 dB per channel (one absmax over a whole row
  stretches the step). Floor: 12 dB, with whole-model floors a step below nf4's.
- w4a8-fp8 (int4's weights, E4M3 activations per token): int4's floors. On SmolLM2-135M the
  activations cost 0.03 dB on the worst linear and 0.009 in KL beside int4's same weights.

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
perplexity ratio quantized/float; encoders: cosine of mean-pooled outputs, its
mean over the sequences) scale with the same per-scheme noise: layer errors add
up over depth. The encoder floor is on the mean, not the worst sequence: the
least of n draws falls as n grows, and failed correct 4-bit conversions at the
default 8 sequences that passed at 2. Measured on all-MiniLM-L6-v2 (36 linears,
each scheme's defaults, the held-out text): pooled cosine mean 0.9994 int8,
0.996 w8a8 (smoothed, per-token; 0.981 static), 0.997 fp8, 0.964 int4 (GPTQ;
0.929 round-to-nearest), 0.960 nf4, and with one intermediate linear's scale
doubled 0.925 int8, 0.883 int4, 0.896 nf4; hence floors of 0.998 / 0.98 /
0.95 / 0.98 / 0.91 / 0.93. Each default can be overridden by a CLI flag.
"""

from __future__ import annotations

import dataclasses
import math

from qconvert.formats.errors import UsageError
from qconvert.schemes import SCHEMES
from qconvert.schemes.base import Thresholds


# The thresholds live with each scheme (qconvert/schemes); these are their views by name.
DEFAULT_THRESHOLDS: dict[str, Thresholds] = {name: scheme.thresholds for name, scheme in SCHEMES.items()}
STATIC_ACT_THRESHOLDS: dict[str, Thresholds] = {name: scheme.static_thresholds for name, scheme in SCHEMES.items()
                                                if scheme.static_thresholds is not None}


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
    return dataclasses.replace(SCHEMES[scheme].verify_thresholds(act), **given)


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
