"""qconvert's error types, the bottom of the import graph: FormatError for a file on disk that is corrupt or
inconsistent with the format it claims, and the user-facing errors with the exit codes the CLI maps them to.

Only the standard library is imported here, so every layer may raise these.
"""

from __future__ import annotations

import sys


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


class ClusterError(QConvertError):
    """Another process of a run of several failed or vanished, or the processes could not join."""

    exit_code = 10


class VerificationFailed(QConvertError):
    """A converted folder did not pass verify's checks."""

    exit_code = 1


def require_converted_folder(folder) -> None:
    """ModelNotFoundError (exit 3, as every command says it) unless `folder`, an OUT to read, is a folder: one
    that is not there, or a file. Light (no JAX), so the CLI says it before importing the readers."""
    from pathlib import Path

    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"no such folder: {folder}" if not folder.exists() else
                                 f"{folder} is not a folder; give the output folder of `qconvert quantize`")


INTERRUPTED_EXIT_CODE = 130

# The exit codes of every command, as the README and each command's --help list them.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (0, "success"),
    (1, "a check failed (verify, or inspect finding a changed file)"),
    (2, "usage error (bad flags or arguments, OUT that would overwrite the input or the current folder; "
        "--upload-repo: no token, HF_HUB_OFFLINE set, or a token, repository or upload the Hub refuses)"),
    (3, "model not found"),
    (4, "Hub unreachable and nothing cached (--upload-repo: the Hub did not answer the upload, or failed it)"),
    (5, "unsupported architecture or pickle-only checkpoint"),
    (6, "invalid checkpoint (config.json that disagrees with the weights, index or safetensors file)"),
    (7, "a weight with NaN/Inf or a shape the scheme cannot take"),
    (8, "OUT exists (and is not a folder qconvert wrote, or --overwrite was not given)"),
    (9, "writing the output failed (e.g. a full disk)"),
    (10, "a run of several processes: the processes could not join, or one stopped without a word (the line names it)"),
    (70, "internal error: a bug in qconvert (QCONVERT_DEBUG=1 shows the traceback)"),
    (129, "interrupted by SIGHUP"),
    (130, "interrupted (Ctrl-C, SIGINT)"),
    (143, "interrupted by SIGTERM"),
)


def kernel_error_exit_code(err: BaseException) -> int | None:
    """The exit code for a kernels KernelArgumentError (a usage error, 2), or None for any other error.

    The kernels package has its own error type and no exit codes; it is looked up
    only when already imported, so the CLI does not import JAX to map an error.
    """
    kernel_errors = sys.modules.get("qconvert.kernels.errors")
    if kernel_errors is not None and isinstance(err, kernel_errors.KernelArgumentError):
        return UsageError.exit_code
    return None


class FormatError(ValueError):
    """Raised for any corrupt or inconsistent checkpoint file; the message names the file."""
