"""The model a command reads: MODEL resolved once, its checkpoint opened once, its family found once and its
model built once.

`quantize` and `calibrate` both start here, so everything a run reads (the
config, calibration's weights, the weights written) comes from the one folder
(for a Hub id, the one commit) that `resolve_source` picked.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from qconvert.formats.dequantized_checkpoint import DequantizedCheckpoint
from qconvert.formats.errors import FormatError, InvalidCheckpointError, UnsupportedModelError
from qconvert.formats.quantized_sources import READS, NotReadable, SourceFormat, dequantized_dtype, source_format
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, open_checkpoint
from qconvert.source.hub import ResolvedModel, resolve_model
from qconvert.models.family import Family, FamilyFacts
from qconvert.models.registry import family_for
from qconvert.models.weight_only import WeightOnlySelection, check_architecture, checkpoint_family
from qconvert.schemes import names_where
from qconvert.schemes.base import Scheme
from qconvert.stages import stage


@dataclasses.dataclass
class SourceModel:
    """A resolved model with its checkpoint open (headers read, tensors read when asked for).

    `family` is config.json's family class (the --any-architecture fallback's facts where
    `weight_only` is set); `model` its forward, built on first use and then shared by every
    stage of the command. A quantized source qconvert reads as float (`source_format` set) is seen as
    the float checkpoint it stands for: its config without the quantization_config, its weights
    dequantized as they are read (formats/dequantized_checkpoint.py).
    """

    resolved: ResolvedModel
    checkpoint: SafetensorsCheckpoint | DequantizedCheckpoint
    family: FamilyFacts
    weight_only: WeightOnlySelection | None = None  # set when --any-architecture chose the linears
    source_format: SourceFormat | None = None  # the quantized format read as float; None for a float source
    _params: Any = dataclasses.field(default=None, repr=False)
    _model: Any = dataclasses.field(default=None, repr=False)

    @property
    def folder(self) -> Path:
        return self.resolved.folder

    def summary(self) -> dict[str, Any]:
        """The source as `quantize --json` and `calibrate --json` name it: model, Hub or not, revision, commit, and
        the quantized format read as float (None for a float source)."""
        resolved = self.resolved
        return {"model": resolved.model_id, "is_hub": resolved.is_hub, "revision": resolved.revision,
                "commit": resolved.commit, "format": self.source_format.name if self.source_format else None}

    @property
    def config(self) -> dict[str, Any]:
        return self.resolved.config

    @property
    def params(self):
        """The checkpoint as a lazy read-only Mapping name -> array (what the model forwards take)."""
        if self._params is None:
            from qconvert.formats.checkpoint_params import CheckpointParams

            self._params = CheckpointParams(self.checkpoint)
        return self._params

    @property
    def model(self) -> Family:
        """The family's forward for config.json, built once (InvalidCheckpointError for a bad config value;
        TypeError for the --any-architecture fallback, which has none)."""
        if self._model is None:
            if self.weight_only is not None:
                raise TypeError(f"{self.weight_only.architecture} is converted weight-only and has no forward pass")
            self._model = self.family.from_checkpoint(self.config, self.checkpoint.tensor_names)
        return self._model

    def check_weights(self) -> None:
        """Raise InvalidCheckpointError when the weights do not fit config.json (shapes, names)."""
        from qconvert.source.consistency import check_weights_match_config

        check_weights_match_config(self.checkpoint, self.config, lambda: self.model)

    def close(self) -> None:
        self.checkpoint.close()

    def __enter__(self) -> "SourceModel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def resolve_source(model: str, revision: str | None = None, *, scheme: Scheme | None = None,
                   any_architecture: bool = False) -> ResolvedModel:
    """MODEL (a folder or Hub id) as a local folder; its family is found before any weight moves.

    With `scheme`, the check is the conversion's (--any-architecture lets an
    unknown decoder through for the weight-only schemes); without, the model
    must be of a known family. The ResolvedModel keeps the family found.
    """
    family_check = family_for if scheme is None else functools.partial(
        check_architecture, any_architecture=any_architecture, scheme=scheme.name,
        weight_only=scheme.weight_only, weight_only_schemes=names_where(lambda s: s.weight_only))

    def check(config):
        readable_format(model, config)
        return family_check(config)

    with stage("resolving the model"):
        return resolve_model(model, revision, check_architecture=check)


def readable_format(model: str, config: dict) -> SourceFormat | None:
    """The quantized format of MODEL that qconvert reads as float (None for a float checkpoint); for any other
    quantized checkpoint, UnsupportedModelError (exit 5) naming its format, before a weight is read. Every
    command that reads a float model (quantize's MODEL, calibrate's, verify's --reference) asks here."""
    if "quantization_config" not in config:
        return None
    quantization = config["quantization_config"]
    try:
        return source_format(quantization)
    except NotReadable as err:
        raise UnsupportedModelError(
            f"{model} is already quantized (its config.json has a quantization_config, {err}); qconvert reads "
            f"float checkpoints, and {READS}: give the float model it was made from") from None


def open_source(resolved: ResolvedModel, *, any_architecture: bool = False) -> SourceModel:
    """Open the resolved folder's safetensors (every header checked) with the family resolving found (for an
    unknown decoder under --any-architecture, the layer-prefix rule's choice from the headers)."""
    fmt = readable_format(resolved.model_id, resolved.config)
    try:
        checkpoint = open_checkpoint(resolved.folder)
    except FormatError as err:
        raise InvalidCheckpointError(str(err)) from None
    if fmt is not None:  # a float source takes none of this: its checkpoint and config as they are
        checkpoint, resolved = _read_as_float(checkpoint, resolved, fmt)
    try:
        family, weight_only = checkpoint_family(resolved.config, checkpoint, any_architecture=any_architecture,
                                                family=resolved.family)
    except BaseException:
        checkpoint.close()
        raise
    return SourceModel(resolved, checkpoint, family, weight_only, source_format=fmt)


def _read_as_float(checkpoint: SafetensorsCheckpoint, resolved: ResolvedModel,
                   fmt: SourceFormat) -> tuple[DequantizedCheckpoint, ResolvedModel]:
    """A quantized source as the float model it stands for: its weights dequantized as they are read, its config
    without the quantization_config (the output gets qconvert's own)."""
    try:
        view = DequantizedCheckpoint(checkpoint, fmt, dequantized_dtype(fmt, resolved.config))
    except (FormatError, InvalidCheckpointError) as err:
        checkpoint.close()
        raise InvalidCheckpointError(str(err)) from None
    config = {key: value for key, value in resolved.config.items() if key != "quantization_config"}
    return view, dataclasses.replace(resolved, config=config)
