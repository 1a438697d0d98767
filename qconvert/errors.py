"""The user-facing error types of qconvert and the exit codes the CLI maps them to."""

from __future__ import annotations


class QConvertError(Exception):
    """A mistake in what the user asked for or gave us; the CLI prints one line."""

    exit_code = 2


class UsageError(QConvertError):
    """Flags or arguments that do not fit together."""

    exit_code = 2


class ModelNotFoundError(QConvertError):
    """A local folder that does not exist, or a Hub id that cannot be resolved."""

    exit_code = 3


class HubUnavailableError(QConvertError):
    """The Hub cannot be reached and nothing usable is cached."""

    exit_code = 4


class UnsupportedModelError(QConvertError):
    """An architecture, or a checkpoint format (pickles), that qconvert does not take."""

    exit_code = 5


class InvalidCheckpointError(QConvertError):
    """config.json, an index or a safetensors file that is missing, corrupt or inconsistent."""

    exit_code = 6


class InvalidWeightError(QConvertError):
    """A weight with NaN/Inf values or a shape the chosen scheme cannot take."""

    exit_code = 7


class OutputExistsError(QConvertError):
    """The output folder exists and --overwrite was not given."""

    exit_code = 8


class OutputWriteError(QConvertError):
    """Writing the output failed (a full disk, permissions)."""

    exit_code = 9


class KernelArgumentError(QConvertError):
    """Arguments to a kernel whose dtype, rank, shape or layout do not fit."""

    exit_code = 2


class VerificationFailed(QConvertError):
    """A converted folder did not pass verify's checks."""

    exit_code = 1


INTERRUPTED_EXIT_CODE = 130
