"""A quantization scheme as one object: everything about `--scheme NAME` in one class.

A Scheme holds its name, its on-disk layout (formats/layout_*.py), its weight
quantizer (whole tensor and a block of rows at a time), its clip grid and
search, the flags it takes, whether it calibrates, its activation mode (what
the kernels get), and its verify thresholds. The CLI's choices, the options
checks, the pipeline and verify ask the scheme; none of them compares names.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import Layout, LayoutFlags
from qconvert.formats.qarray import QArray, group_scale
from qconvert.schemes.rowwise import quantize_rows


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What one search chose, and the error it reached against the plain (ratio 1) choice."""

    ratios: np.ndarray      # float32: per row, per block, or one per tensor
    error_plain: float      # summed squared error with ratio 1
    error_searched: float   # summed squared error with the chosen ratios


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """What a converted folder must reach to pass verify."""

    min_layer_sqnr_db: float
    min_layer_cosine: float
    max_mean_kl: float
    min_top1_agreement: float
    max_perplexity_ratio: float
    min_pooled_cosine: float
    min_fidelity_sqnr_db: float = 60.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ClipSearch:
    """A scheme's clipping search: its grid, what one ratio scales, and the search over a weight."""

    grid: tuple[float, ...]
    what: str


class Scheme(abc.ABC):
    """One `--scheme`. Subclasses set the class attributes and implement quantize and clip_search."""

    name: str
    layout: Layout
    vllm_loads: bool = True          # vLLM has a loader for its layout (the model card's load snippet)
    act_modes: tuple[str, ...] = ()  # activation modes it quantizes with; () keeps activations float
    calibrates: bool = False         # takes calibration and smoothing (--calib, --alpha, ...)
    # Its folder holds a static activation scale per quantized linear from calibration whatever --act says
    # (NVFP4's input_global_scale): the run calibrates (--calib), and `input_scales` makes the scales.
    calibrated_inputs: bool = False
    default_scale_search: bool = False
    default_gptq: bool = False       # GPTQ rounding unless --no-gptq (a scheme that calibrates anyway)
    default_awq: bool = False        # AWQ's scales before rounding unless --no-awq (docs/ACCURACY.md)
    takes_double_quant: bool = False
    takes_group_size: bool = False
    # Its quantization_config can carry compressed-tensors' kv_cache_scheme (--kv-cache): every
    # compressed-tensors layout; bitsandbytes' (nf4) has none.
    writes_kv_cache_scheme: bool = True

    @property
    def summary(self) -> str:
        """One line: what it stores (qconvert.schemes.DESCRIPTIONS)."""
        from qconvert.schemes import DESCRIPTIONS

        return DESCRIPTIONS[self.name][0]

    @property
    def loads_in(self) -> str:
        """The loaders that read its layout, as measured (qconvert.schemes.DESCRIPTIONS)."""
        from qconvert.schemes import DESCRIPTIONS

        return DESCRIPTIONS[self.name][1]

    def servers(self, flags: LayoutFlags, config: Mapping, kv_cache: bool = False) -> dict[str, str]:
        """Each server's recorded answer for a folder of this scheme with `flags` of the model `config`
        (qconvert.schemes.servers: the cells `qconvert inspect` prints and the model card writes)."""
        from qconvert.schemes.servers import family_of, scheme_key, servers

        return servers(scheme_key(self.name, flags), family_of(config), kv_cache=kv_cache)

    clip: ClipSearch
    thresholds: Thresholds
    static_thresholds: Thresholds | None = None  # with --act static, where it differs

    @property
    def weight_only(self) -> bool:
        """Whether activations stay float (the --any-architecture schemes)."""
        return not self.act_modes

    def layout_flags(self, *, act: str = "dynamic", double_quant: bool = False, group_size: int | str | None = None,
                     shapes: Mapping[str, tuple[int, int]] | None = None) -> LayoutFlags:
        """The layout flags of a run's options, given the quantized linears' [out, in] shapes."""
        return LayoutFlags(static_act=act == "static", double_quant=double_quant)

    def group_note(self, group_size: int | str | None, shapes: Mapping[str, tuple[int, int]]) -> str:
        """One line to show the user about the layout's grouping ('' when there is nothing to say)."""
        return ""

    def check_modules(self, modules: list[str], flags: LayoutFlags) -> None:
        """UsageError when the chosen linears cannot be written so that the servers load them."""

    @abc.abstractmethod
    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        """The QArray of a float [out, in] weight; `clip` holds searched ratios (clip.grid's units)."""

    def quantize_rows(self, read_rows: Callable[[int, int], np.ndarray], shape: tuple[int, int],
                      dtype: np.dtype, flags: LayoutFlags) -> QArray:
        """The same QArray as quantize, from blocks of rows read a block at a time (no clip)."""
        return quantize_rows(lambda part: self.quantize(part, flags, scale_dtype=dtype), read_rows, shape, dtype)

    @abc.abstractmethod
    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        """The per row/group/block ratios minimising the weight's squared error (a SearchResult)."""

    def shared_absmax(self, modules: Sequence[str], absmax: Callable[[str], float]) -> dict[str, float]:
        """Per linear, the absmax its scales are computed from where the scheme shares one between the linears a
        server fuses (NVFP4's global scale across q/k/v and gate/up), given each linear's own `absmax(module)`;
        the writer then passes it to quantize and quantize_rows as `shared_absmax`. {}: every linear its own."""
        return {}

    def input_scales(self, absmax: Mapping[str, float], dtypes: Mapping[str, np.dtype]) -> dict[str, float]:
        """Per linear, the activation scale a scheme with calibrated_inputs stores, from max|x| of the calibrated
        inputs as the quantized linear sees them (after smoothing or AWQ's folding) and its weight's dtype."""
        raise NotImplementedError(f"--scheme {self.name} stores no calibrated activation scale")

    def gptq_grid(self):
        """The grid GPTQ rounds each column onto (a qconvert.methods.gptq_core grid); None: the scheme takes no --gptq."""
        return None

    def gptq_steps(self, q: QArray, flags: LayoutFlags) -> np.ndarray:
        """float32 [out, in]: each weight's scale in round-to-nearest's QArray `q`, which GPTQ keeps (numpy: no
        program to compile per shape)."""
        scale = np.asarray(q.scale).astype(np.float32)
        if scale.shape[-1] not in (1, q.shape[-1]):
            scale = np.repeat(scale, q.shape[-1] // scale.shape[-1], axis=-1)
        return np.ascontiguousarray(np.broadcast_to(scale, q.shape))

    def gptq_offsets(self, q: QArray, flags: LayoutFlags) -> np.ndarray | None:
        """float32 [out, in]: each weight's zero point in `q`, which GPTQ keeps (None: a symmetric grid)."""
        return None

    def gptq_qarray(self, q: QArray, codes: np.ndarray) -> QArray:
        """`q` with GPTQ's codes [out, in] (the grid's) in place of round-to-nearest's: the same scales."""
        return dataclasses.replace(q, qvalue=np.asarray(codes).astype(np.asarray(q.qvalue).dtype))

    def verify_thresholds(self, act: str) -> Thresholds:
        """verify's default thresholds for a folder of this scheme and activation mode."""
        return self.static_thresholds if act == "static" and self.static_thresholds else self.thresholds

    def folder_activations(self, x: np.ndarray, input_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
        """(codes, per-row scales), float64, of activations x [M, K] as the deployment rounds them
        (verify's fidelity); only for a scheme with act_modes."""
        raise NotImplementedError(f"--scheme {self.name} keeps activations in float")

    def kernel_activations(self, x, input_scale):
        """jnp: activations x [M, K] rounded as the server rounds them ahead of a weight-only kernel, with the
        stored `input_scale` (one, or one per row); only for a scheme with calibrated_inputs."""
        raise NotImplementedError(f"--scheme {self.name} stores no calibrated activation scale")

    def folder_weight(self, q: QArray) -> np.ndarray:
        """The float64 weight the folder's tensors define: codes times their scale (verify's fidelity)."""
        return np.asarray(q.qvalue, np.float64) * np.asarray(group_scale(q), np.float64)

    def check_options(self, *, act: str, double_quant: bool, group_size, calibrates: bool) -> None:
        """UsageError for a flag this scheme does not take; the message names the schemes that do."""
        from qconvert.schemes import names_where

        if calibrates and not self.calibrates:
            raise UsageError("--calib, --alpha, --no-smooth, --act and --act-stats apply to --scheme "
                             f"{names_where(lambda s: s.calibrates)} only (--calib, --calib-samples, "
                             "--calib-seqlen and --shard-experts also with --gptq, --awq or --kv-cache)")
        if double_quant and not self.takes_double_quant:
            raise UsageError(f"--double-quant applies to --scheme {names_where(lambda s: s.takes_double_quant)} only")
        if act not in ("dynamic", "static"):
            raise UsageError(f"--act must be dynamic or static, not {act!r}")
        if act == "static" and "static" not in self.act_modes:
            raise UsageError(f"static activation scales apply to --scheme "
                             f"{names_where(lambda s: 'static' in s.act_modes)} only")
        if group_size is not None and not self.takes_group_size:
            raise UsageError(f"--group-size applies to --scheme {names_where(lambda s: s.takes_group_size)} only")
