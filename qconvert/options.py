"""The choices of one `qconvert quantize` run, checked once, on construction.

ConvertOptions holds everything a conversion takes, `act` included; its
`w8a8` part (W8A8Options) holds calibration and smoothing. Every combination
that does not fit is refused here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
from qconvert.formats.errors import UsageError
from qconvert.write import prefetch
from qconvert.schemes import scheme_named
from qconvert.schemes.base import Scheme

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# --group-size: a whole number of input columns, or "channel" (one scale per output channel).
GROUP_SIZE_CHOICES = (32, 64, 128, "channel")


@dataclasses.dataclass(frozen=True)
class W8A8Options:
    """Calibration and smoothing of --scheme w8a8 (its activation mode is ConvertOptions.act)."""

    calib: str | None = None          # None: the built-in corpus
    calib_samples: int = DEFAULT_SAMPLES
    calib_seqlen: int = DEFAULT_SEQLEN
    alpha: str | None = None          # None: 'auto' (or the family's value with act_stats)
    smooth: bool = True
    act_stats: Path | None = None     # a `qconvert calibrate` file instead of calibrating
    batch_size: int | None = None     # calibration windows per forward; None: calibration's default

    def alpha_spec(self):
        """The parsed --alpha (a qconvert.methods.smooth.AlphaSpec) as calibration uses it.

        A statistics file holds no activation rows to search on, so with
        act_stats the default 'auto' becomes the family's alpha.
        """
        from qconvert.methods.smooth import AlphaSpec, parse_alpha

        spec = parse_alpha(self.alpha)
        if self.act_stats is not None and spec.auto:
            return AlphaSpec()
        return spec


# Options that change no output byte stay out of qconvert.json, so reruns with them stay identical.
# (--any-architecture changes nothing for a known family; where it applies, qconvert.json
# records the weight-only selection itself.)
PRESENTATION_OPTIONS = ("overwrite", "dry_run", "any_architecture", "workers")
# The w8a8 calibration and smoothing choices are recorded in full as qconvert.json's
# `calibration` and `smoothing`, not among the flags.
RECORDED_ELSEWHERE = ("w8a8", "gptq", "gptq_damp", "gptq_act_order")  # GPTQ's: as `rounding`
# Recorded only for the schemes that take them (so other schemes' records stay as they were).
SCHEME_ONLY_OPTIONS = ("group_size",)


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """Every choice a conversion takes; validated on construction."""

    scheme: str = "int8"
    revision: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    double_quant: bool = False
    # int4: input columns per scale; None: 128, or the largest of 64 and 32 that divides every width.
    group_size: int | str | None = None
    act: str = "dynamic"
    # None: on for w8a8 (searched on calibration activations), off for int8 and nf4.
    scale_search: bool | None = None
    overwrite: bool = False
    dry_run: bool = False
    # An unknown decoder converts weight-only, its linears found by the layer-prefix rule
    # (qconvert.models.weight_only); a known family always keeps its own list.
    any_architecture: bool = False
    # Threads that read and quantize tensors ahead of the writer; None: one per available core.
    # The output bytes are the same whatever the count.
    workers: int | None = None
    # Calibration and smoothing: w8a8's, and the calibration text of GPTQ (None there means the defaults).
    w8a8: W8A8Options | None = None
    # GPTQ rounding (qconvert.methods.gptq_core); None: the scheme's default (on for int4, unless activation statistics
    # replace calibration; opt-in for w8a8, where it cost real LLMs perplexity after smoothing).
    gptq: bool | None = None
    gptq_damp: float | None = None    # None: qconvert.methods.gptq_core.DEFAULT_DAMP
    gptq_act_order: bool = False

    def __post_init__(self):
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        scheme = scheme_named(self.scheme)
        _check_gptq(self, scheme)
        text_only = self.w8a8 is not None and not _smoothing_given(self.w8a8) and self.act == "dynamic"
        scheme.check_options(act=self.act, double_quant=self.double_quant, group_size=self.group_size,
                             calibrates=self.w8a8 is not None and not (self.uses_gptq and text_only))
        if self.group_size is not None and self.group_size not in GROUP_SIZE_CHOICES:
            raise UsageError(f"--group-size must be 32, 64, 128 or channel, not {self.group_size!r}")
        if self.max_shard_size <= 0:
            raise UsageError("--max-shard-size must be positive")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise UsageError(f"--workers must be a whole number of at least 1, not {self.workers!r}")
        if self.workers is not None and self.workers > prefetch.max_workers():
            raise UsageError(f"--workers {self.workers} is more than {prefetch.WORKERS_PER_CORE} threads per core "
                             f"({prefetch.max_workers()} on this machine's {prefetch.available_cores()} cores); "
                             f"give at most {prefetch.max_workers()}")
        if scheme.calibrates or self.uses_gptq:
            if self.w8a8 is None:
                object.__setattr__(self, "w8a8", W8A8Options())
            _check_w8a8(self.w8a8)

    @property
    def scheme_object(self) -> Scheme:
        """The Scheme this run writes."""
        return scheme_named(self.scheme)

    def recorded_flags(self, layout_flags) -> dict:
        """qconvert.json's `flags`: every option that changes output bytes and is recorded nowhere else.

        A scheme that takes a group size records the one written (`layout_flags`, the plan's), whatever was asked.
        """
        flags = {k: v for k, v in dataclasses.asdict(self).items()
                 if k not in PRESENTATION_OPTIONS + RECORDED_ELSEWHERE + SCHEME_ONLY_OPTIONS}
        if self.scheme_object.takes_group_size:
            flags["group_size"] = (layout_flags.group_size if layout_flags is not None else self.group_size) or "channel"
        flags["include"], flags["exclude"] = list(self.include), list(self.exclude)
        flags["scale_search"] = self.searches_scales
        return flags

    @property
    def searches_scales(self) -> bool:
        """Whether scales are searched (clipping ratios) rather than plain absmax: --scale-search."""
        return self.scheme_object.default_scale_search if self.scale_search is None else bool(self.scale_search)


    @property
    def uses_gptq(self) -> bool:
        """Whether weights are rounded by GPTQ: --gptq/--no-gptq, else the scheme's default (off when a
        statistics file replaces calibration: it holds no Hessians)."""
        if self.gptq is not None:
            return bool(self.gptq)
        return self.scheme_object.default_gptq and (self.w8a8 is None or self.w8a8.act_stats is None)

    @property
    def gptq_config(self):
        """The run's qconvert.methods.gptq_core.GPTQConfig (dampening, block size, act order)."""
        from qconvert.methods.gptq_core import DEFAULT_DAMP, GPTQConfig

        return GPTQConfig(damp=DEFAULT_DAMP if self.gptq_damp is None else float(self.gptq_damp),
                          act_order=self.gptq_act_order)


def _smoothing_given(options: W8A8Options) -> bool:
    """Whether w8a8's own flags (not the calibration text's) were given."""
    return options.alpha is not None or not options.smooth or options.act_stats is not None


def _check_gptq(options: ConvertOptions, scheme: Scheme) -> None:
    """Refuse GPTQ flags that do not fit the scheme or each other."""
    if options.gptq and scheme.gptq_grid() is None:
        raise UsageError(f"--gptq applies to --scheme {_gptq_schemes()} only")
    if options.gptq and options.w8a8 is not None and options.w8a8.act_stats is not None:
        raise UsageError("--gptq needs calibration activations, which a statistics file does not hold; "
                         "drop --act-stats, or pass --no-gptq")
    damp = options.gptq_damp
    if damp is not None and (isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp <= 1):
        raise UsageError(f"--gptq-damp must be a fraction in (0, 1] of the mean Hessian diagonal, not {damp!r}")
    if (damp is not None or options.gptq_act_order) and not options.uses_gptq:
        raise UsageError("--gptq-damp and --gptq-act-order apply with GPTQ only: pass --gptq "
                         f"(on by default for --scheme {_default_gptq_schemes()})")


def _gptq_schemes() -> str:
    from qconvert.schemes import names_where

    return names_where(lambda s: s.gptq_grid() is not None)


def _default_gptq_schemes() -> str:
    from qconvert.schemes import names_where

    return names_where(lambda s: s.default_gptq)


def _check_w8a8(options: W8A8Options) -> None:
    """Refuse calibration and smoothing flags that do not fit together."""
    from qconvert.methods.smooth import parse_alpha

    spec = parse_alpha(options.alpha)
    if not options.smooth and options.alpha is not None:
        raise UsageError("--alpha has no effect with --no-smooth; drop one of them")
    if options.act_stats is not None and options.calib is not None:
        raise UsageError("--act-stats replaces calibration; drop --calib (or --act-stats)")
    if options.act_stats is not None and spec.auto and options.alpha is not None:
        raise UsageError("--alpha auto searches on calibration activations, which a statistics file "
                         "does not hold; drop --act-stats or give a fixed --alpha")
