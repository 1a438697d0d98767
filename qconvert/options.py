"""The choices of one `qconvert quantize` run, checked once, on construction.

ConvertOptions holds everything a conversion takes, `act` included; its
`calibration` part (CalibrationOptions) holds the calibration text and smoothing, for every
scheme that calibrates or rounds by GPTQ. Values are parsed once here and the parse is
carried (the Scheme, the AlphaSpec). Every combination that does not fit is refused here and
nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
from qconvert.calibration.documents import check_calibration_source
from qconvert.calibration.hub_dataset import DatasetSelection
from qconvert.formats.errors import UsageError
from qconvert.write import prefetch
from qconvert.schemes import scheme_named
from qconvert.schemes.base import Scheme

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
# --group-size: a whole number of input columns, or "channel" (one scale per output channel).
GROUP_SIZE_CHOICES = (32, 64, 128, "channel")


@dataclasses.dataclass(frozen=True)
class AlphaSpec:
    """--alpha as given: 'auto' (the default), 'family', one value, or 'KEY=VALUE,...' per group."""

    auto: bool = False
    default: float | None = None
    per_group: tuple[tuple[str, float], ...] = ()

    def alpha_for(self, source: str, family_default: float) -> float:
        """The alpha of the group whose source module is `source` (longest matching key wins)."""
        best = None
        for key, value in self.per_group:
            if source == key or source.endswith("." + key):
                if best is None or len(key) > len(best[0]):
                    best = (key, value)
        if best is not None:
            return best[1]
        return self.default if self.default is not None else family_default

    def unmatched_keys(self, sources: Sequence[str]) -> list[str]:
        """Per-group keys that match no group's source (a typo the user should hear about)."""
        return [key for key, _ in self.per_group
                if not any(s == key or s.endswith("." + key) for s in sources)]



def _alpha_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"--alpha value {text!r} is not a number; write e.g. 0.85, "
                         "'auto', 'family' or 'input_layernorm=0.8,post_attention_layernorm=0.6'") from None
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"--alpha {value} is outside [0, 1]; SmoothQuant's alpha is a fraction")
    return value



def parse_alpha(text: str | None) -> AlphaSpec:
    """Parse --alpha: None or 'auto' (search per group), 'family' (the family's value), '0.8',
    or '0.8,post_attention_layernorm=0.6'."""
    text = "auto" if text is None else text.strip()
    if text == "auto":
        return AlphaSpec(auto=True)
    if text == "family":
        return AlphaSpec()
    default, per_group = None, []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" in part:
            key, value = (x.strip() for x in part.split("=", 1))
            if not key:
                raise UsageError(f"--alpha entry {part!r} names no group; write GROUP=VALUE")
            per_group.append((key, _alpha_value(value)))
        elif default is None:
            default = _alpha_value(part)
        else:
            raise UsageError(f"--alpha {text!r} has two bare values; give one default and GROUP=VALUE pairs")
    if default is None and not per_group:
        raise UsageError("--alpha is empty; write e.g. 0.85 or 'auto'")
    return AlphaSpec(default=default, per_group=tuple(per_group))



@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """The calibration text (any scheme that calibrates or rounds by GPTQ) and w8a8's smoothing (its activation
    mode is ConvertOptions.act)."""

    calib: str | None = None          # None: the built-in corpus
    calib_samples: int = DEFAULT_SAMPLES
    calib_seqlen: int = DEFAULT_SEQLEN
    calib_split: str | None = None    # a whole Hub dataset's split, column and config (None: the defaults)
    calib_column: str | None = None
    calib_config: str | None = None
    alpha: str | None = None          # None: 'auto' (or the family's value with act_stats)
    smooth: bool = True
    act_stats: Path | None = None     # a `qconvert calibrate` file instead of calibrating
    batch_size: int | None = None     # calibration windows per forward; None: calibration's default
    shard_experts: bool | None = None  # split MoE layers' experts over the devices; None: where they do not fit

    def __post_init__(self):
        check_calibration_source(self.calib, self.dataset)
        # --alpha parsed once (UsageError here for a bad value), the parse carried.
        object.__setattr__(self, "_alpha_spec", parse_alpha(self.alpha))

    @property
    def dataset(self) -> DatasetSelection:
        """What of a whole Hub dataset --calib reads."""
        return DatasetSelection(config=self.calib_config, split=self.calib_split, column=self.calib_column)

    @property
    def given_alpha_spec(self) -> AlphaSpec:
        """--alpha as parsed."""
        return self._alpha_spec

    @property
    def alpha_spec(self) -> AlphaSpec:
        """--alpha as calibration uses it: a statistics file holds no activation rows to search on, so with
        act_stats the default 'auto' becomes the family's alpha."""
        if self.act_stats is not None and self._alpha_spec.auto:
            return AlphaSpec()
        return self._alpha_spec


# Options that change no output byte stay out of qconvert.json, so reruns with them stay identical.
# (--any-architecture changes nothing for a known family; where it applies, qconvert.json
# records the weight-only selection itself.)
PRESENTATION_OPTIONS = ("overwrite", "dry_run", "any_architecture", "workers")
# The calibration and smoothing choices are recorded in full as qconvert.json's
# `calibration` and `smoothing`, not among the flags.
RECORDED_ELSEWHERE = ("calibration", "gptq", "gptq_damp", "gptq_act_order",  # GPTQ's: as `rounding`
                      "awq",  # AWQ's: as `smoothing`, method "awq"
                      "kv_cache")  # the KV cache's scales: as `kv_cache`
# Recorded only for the schemes that take them (so other schemes' records stay as they were).
SCHEME_ONLY_OPTIONS = ("group_size",)
# Recorded only when given (it changes the model card alone), under the flag's own name.
GIVEN_ONLY_OPTIONS = {"card_repo": "upload_repo"}


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
    # The calibration text and smoothing: w8a8's, and GPTQ's text for any scheme (None: the defaults).
    calibration: CalibrationOptions | None = None
    # GPTQ rounding (qconvert.methods.gptq_core); None: the scheme's default (on for int4, unless activation statistics
    # replace calibration; opt-in for w8a8, where it cost real LLMs perplexity after smoothing).
    gptq: bool | None = None
    gptq_damp: float | None = None    # None: qconvert.methods.gptq_core.DEFAULT_DAMP
    gptq_act_order: bool | None = None  # None: qconvert.methods.gptq_core.DEFAULT_ACT_ORDER
    # AWQ's per-channel scales searched on calibration rows and folded before rounding (qconvert.methods.awq);
    # None: the scheme's default (on for int4 and int4-asym, unless activation statistics replace calibration).
    awq: bool | None = None
    # The Hub repository (OWNER/NAME) OUT is written for (--upload-repo): the model card loads from there.
    card_repo: str | None = None
    # KV-cache scales calibrated and written beside the weights (--kv-cache fp8); None: none.
    kv_cache: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        scheme = scheme_named(self.scheme)
        object.__setattr__(self, "scheme", scheme.name)  # a preset name given (W4A16) is recorded as the scheme's
        object.__setattr__(self, "_scheme", scheme)  # looked up once, the Scheme carried
        _check_gptq(self, scheme)
        text_only = self.calibration is not None and not _smoothing_given(self.calibration) and not self.static_act
        text_used = self.uses_gptq or self.uses_awq or self.kv_cache is not None or scheme.calibrated_inputs
        scheme.check_options(act=self.act, double_quant=self.double_quant, group_size=self.group_size,
                             calibrates=self.calibration is not None and not (text_used and text_only))
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
        _check_kv_cache(self, scheme)
        if (scheme.calibrates or scheme.calibrated_inputs or self.uses_gptq or self.uses_awq
                or self.kv_cache is not None):
            if self.calibration is None:
                object.__setattr__(self, "calibration", CalibrationOptions())
            _check_calibration(self.calibration)
        if self.awq:
            _check_awq(scheme, self.calibration)

    @property
    def scheme_object(self) -> Scheme:
        """The Scheme this run writes."""
        return self._scheme

    @property
    def static_act(self) -> bool:
        """Whether activations get static per-tensor scales from calibration (--act static)."""
        return self.act == "static"

    def recorded_flags(self, layout_flags) -> dict:
        """qconvert.json's `flags`: every option that changes output bytes and is recorded nowhere else.

        A scheme that takes a group size records the one written (`layout_flags`, the plan's), whatever was asked.
        """
        apart = PRESENTATION_OPTIONS + RECORDED_ELSEWHERE + SCHEME_ONLY_OPTIONS + tuple(GIVEN_ONLY_OPTIONS)
        flags = {k: v for k, v in dataclasses.asdict(self).items() if k not in apart}
        flags.update({name: getattr(self, k) for k, name in GIVEN_ONLY_OPTIONS.items() if getattr(self, k)})
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
    def uses_awq(self) -> bool:
        """Whether AWQ's scales are searched: --awq/--no-awq, else the scheme's default (off when a statistics
        file replaces calibration: it holds no rows). A model with no forward takes rounding instead
        (methods.recipe.runs_awq)."""
        if self.awq is not None:
            return bool(self.awq)
        return self.scheme_object.default_awq and (self.calibration is None or self.calibration.act_stats is None)

    @property
    def uses_gptq(self) -> bool:
        """Whether weights are rounded by GPTQ: --gptq/--no-gptq, else the scheme's default (off when a
        statistics file replaces calibration: it holds no Hessians)."""
        if self.gptq is not None:
            return bool(self.gptq)
        return self.scheme_object.default_gptq and (self.calibration is None or self.calibration.act_stats is None)


def _smoothing_given(options: CalibrationOptions) -> bool:
    """Whether w8a8's own flags (not the calibration text's) were given."""
    return options.alpha is not None or not options.smooth or options.act_stats is not None


def _check_gptq(options: ConvertOptions, scheme: Scheme) -> None:
    """Refuse GPTQ flags that do not fit the scheme or each other."""
    if options.gptq and scheme.gptq_grid() is None:
        raise UsageError(f"--gptq applies to --scheme {_gptq_schemes()} only")
    if options.gptq and options.calibration is not None and options.calibration.act_stats is not None:
        raise UsageError("--gptq needs calibration activations, which a statistics file does not hold; "
                         "drop --act-stats, or pass --no-gptq")
    damp = options.gptq_damp
    if damp is not None and (isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 < damp <= 1):
        raise UsageError(f"--gptq-damp must be a fraction in (0, 1] of the mean Hessian diagonal, not {damp!r}")
    if (damp is not None or options.gptq_act_order is not None) and not options.uses_gptq:
        raise UsageError("--gptq-damp and --gptq-act-order apply with GPTQ only: pass --gptq "
                         f"(on by default for --scheme {_default_gptq_schemes()})")


def _check_kv_cache(options: "ConvertOptions", scheme: Scheme) -> None:
    """Refuse --kv-cache where no loader would read the scales, or calibration cannot make them."""
    from qconvert.formats.kv_cache import KV_CACHE_SCHEMES

    if options.kv_cache is None:
        return
    if options.kv_cache not in KV_CACHE_SCHEMES:
        raise UsageError(f"--kv-cache must be none or {', '.join(KV_CACHE_SCHEMES)}, not {options.kv_cache!r}")
    if not scheme.writes_kv_cache_scheme:
        raise UsageError(f"--kv-cache {options.kv_cache}: --scheme {scheme.name}'s folder has no KV-cache scheme "
                         "its loaders read (bitsandbytes' config has none); use a compressed-tensors scheme, or "
                         "drop --kv-cache")
    if options.calibration is not None and options.calibration.act_stats is not None:
        raise UsageError("--kv-cache calibrates the attention keys and values, which a statistics file does not "
                         "hold; drop --act-stats (or --kv-cache)")


def _check_awq(scheme: Scheme, calibration: CalibrationOptions) -> None:
    """Refuse --awq where it cannot apply: a scheme SmoothQuant smooths (w8a8: the same groups, scaled for its
    int8 activations), and a statistics file instead of calibration (it holds no rows to search on)."""
    from qconvert.schemes import names_where

    if scheme.calibrates:
        raise UsageError(f"--awq applies to --scheme {names_where(lambda s: not s.calibrates)}; --scheme "
                         f"{scheme.name} scales the same groups by SmoothQuant (--alpha)")
    if calibration.act_stats is not None:
        raise UsageError("--awq searches on calibration rows, which a statistics file does not hold; drop "
                         "--act-stats")


def _gptq_schemes() -> str:
    from qconvert.schemes import names_where

    return names_where(lambda s: s.gptq_grid() is not None)


def _default_gptq_schemes() -> str:
    from qconvert.schemes import names_where

    return names_where(lambda s: s.default_gptq)


def _check_calibration(options: CalibrationOptions) -> None:
    """Refuse calibration and smoothing flags that do not fit together."""
    spec = options.given_alpha_spec
    if not options.smooth and options.alpha is not None:
        raise UsageError("--alpha has no effect with --no-smooth; drop one of them")
    if options.act_stats is not None and options.calib is not None:
        raise UsageError("--act-stats replaces calibration; drop --calib (or --act-stats)")
    if options.act_stats is not None and options.shard_experts is not None:
        raise UsageError("--act-stats replaces calibration, whose experts --shard-experts splits; drop "
                         "--shard-experts (or --act-stats)")
    if options.act_stats is not None and spec.auto and options.alpha is not None:
        raise UsageError("--alpha auto searches on calibration activations, which a statistics file "
                         "does not hold; drop --act-stats or give a fixed --alpha")
