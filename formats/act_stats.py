"""The activation statistics file (`qconvert calibrate -o FILE`, `quantize --act-stats FILE`): safetensors holding
<module>.act_absmax [in] and <module>.act_tensor_absmax [1], float32, with what the tokens were in its metadata."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import numpy as np
from safetensors import safe_open

from qconvert.formats.errors import UsageError
from qconvert.formats.safetensors_io import TensorSpec, encode_header

STATS_FORMAT = "qconvert-act-stats"
STATS_VERSION = "1"


@dataclasses.dataclass(frozen=True)
class ActStats:
    """max|x| of every linear's input over the calibration tokens."""

    act_absmax: dict[str, np.ndarray]  # module name -> float32 [in], per input channel
    tokens: int
    calibration: dict[str, Any] | None = None  # what the tokens were (qconvert.json's record)

    def tensor_absmax(self, module: str) -> float:
        """Per-tensor max|x| of a linear's input (the max of its per-channel maxima)."""
        return float(np.max(self.act_absmax[module]))


def write_act_stats(f: BinaryIO, stats: ActStats, model: str = "") -> None:
    """The statistics file's bytes into `f`; the same statistics give the same bytes (formats' header encoder
    sorts the metadata keys)."""
    tensors = {}
    for module, absmax in sorted(stats.act_absmax.items()):
        tensors[f"{module}.act_absmax"] = np.ascontiguousarray(absmax, np.float32)
        tensors[f"{module}.act_tensor_absmax"] = np.asarray([np.max(absmax)], np.float32)
    metadata = {"format": STATS_FORMAT, "version": STATS_VERSION, "model": model,
                "tokens": str(stats.tokens), "calibration": json.dumps(stats.calibration, sort_keys=True)}
    specs = [TensorSpec(name, np.float32, tensors[name].shape) for name in sorted(tensors)]
    f.write(encode_header(specs, metadata))
    for spec in specs:
        f.write(tensors[spec.name].astype("<f4").tobytes())


def is_stats_file(path: Path) -> bool:
    """Whether `path` is a statistics file qconvert wrote (its safetensors metadata says so)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("format") == STATS_FORMAT
    except Exception:  # the safetensors binding raises its own error types: not a stats file
        return False


def _stats_error(path: Path, what: str) -> UsageError:
    return UsageError(f"activation statistics {path}: {what}; write it again with `qconvert calibrate`")


def load_act_stats(path: Path) -> ActStats:
    """Read a statistics file written by save_act_stats (UsageError when it is not one)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"activation statistics file {path} does not exist; "
                         "write one with `qconvert calibrate MODEL -o FILE`")
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != STATS_FORMAT:
                raise UsageError(f"{path} is not a qconvert activation statistics file; "
                                 "write one with `qconvert calibrate MODEL -o FILE`")
            act_absmax = {name[: -len(".act_absmax")]: f.get_tensor(name).astype(np.float32)
                          for name in f.keys() if name.endswith(".act_absmax")}
    except UsageError:
        raise
    except Exception as err:  # the safetensors binding raises its own error types
        raise UsageError(f"cannot read activation statistics {path} ({err}); "
                         "write it again with `qconvert calibrate`") from None
    for module, absmax in sorted(act_absmax.items()):
        # A maximum of |x| is finite and >= 0; anything else would divide smoothing scales by nonsense.
        if absmax.ndim != 1 or not np.all(np.isfinite(absmax)) or np.any(absmax < 0):
            raise _stats_error(path, f"{module}.act_absmax is not a vector of finite maxima >= 0")
    tokens = metadata.get("tokens", "0")
    if not (tokens.isascii() and tokens.isdigit()):
        raise _stats_error(path, f"metadata 'tokens' is {tokens!r}, not a count")
    try:
        calibration = json.loads(metadata.get("calibration", "null"))
    except ValueError:
        calibration = ""
    if calibration is not None and not isinstance(calibration, dict):
        raise _stats_error(path, "metadata 'calibration' is not a JSON object")
    return ActStats(act_absmax, int(tokens), calibration)


def check_stats_cover(stats: ActStats, in_features: Mapping[str, int], where: str) -> None:
    """Raise UsageError unless `stats` has a vector of the right length for every module needed."""
    for module, n in sorted(in_features.items()):
        absmax = stats.act_absmax.get(module)
        if absmax is None:
            raise UsageError(f"{where} has no statistics for {module}; it was calibrated on another "
                             "model: run `qconvert calibrate` on this one")
        if absmax.shape != (n,):
            raise UsageError(f"{where}: statistics of {module} have {absmax.shape[0]} channels, the "
                             f"model's input has {n}; run `qconvert calibrate` on this model")
