"""The output folder: where OUT may be written (refused before any work otherwise), and OUT staged beside itself
and renamed into place, so that a failure leaves no half-written folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qconvert import interrupts
from qconvert.formats.errors import OutputExistsError, OutputWriteError, UsageError
from qconvert.formats.record import RECORD_NAME
from qconvert.formats.safetensors_writer import sha256_file
from qconvert.write.temporaries import (
    TEMPORARY_MARKER, discard, fresh_temporary, make_temporary, release,
)


def check_output_location(out: Path, source: Path | None = None) -> None:
    """Refuse (UsageError, exit 2) an OUT whose replacement would destroy the input or the current folder.

    OUT may not be empty, the current folder or one that holds it, the input
    folder, a folder that holds the input, or a folder inside the input.
    """
    if not str(out).strip():
        raise UsageError("-o is empty; name the output folder to write")
    target = Path(os.path.abspath(out))
    _check_name_length(out, target)
    real = target.resolve()
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise UsageError(f"-o {out} is the current folder or holds it; name a new folder for the output")
    if source is None:
        return
    src = Path(source).resolve()
    if real == src:
        raise UsageError(f"-o {out} is the input model's folder; write the output to a new folder")
    if real in src.parents:
        raise UsageError(f"-o {out} holds the input model ({source}); write the output to a new folder")
    if src in real.parents:
        raise UsageError(f"-o {out} lies inside the input model's folder ({source}); write the output elsewhere")


def _check_name_length(out: Path, target: Path) -> None:
    """UsageError when OUT's name is longer than its file system takes (it would fail only once the work is
    done); the temporary names it is staged under are bounded to fit (temporaries.temporary_stem)."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = 255
    length = len(os.fsencode(target.name))
    if length > name_max:
        raise UsageError(f"-o {out}: its name is {length} bytes, beyond the {name_max} this file system takes; "
                         f"choose a name of at most {name_max} bytes")


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(folder: Path, what: str) -> None:
    """OutputWriteError (exit 9) before a long run when `what` could not be written in `folder` (or the nearest
    folder of it that exists, where it would be made): proven by making a nameless temporary file there."""
    where = _nearest_existing(folder)
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as err:
        raise OutputWriteError(f"cannot write {what} in {where}: {err.strerror or err}; choose a place you can "
                               "write to, before anything is computed") from None


def free_bytes(folder: Path) -> int:
    """Bytes free on the disk that holds `folder` (or the nearest folder of it that exists)."""
    return shutil.disk_usage(_nearest_existing(folder)).free


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """OutputWriteError (exit 9) before a long run when the disk of `folder` has less than `needed` bytes free."""
    free = free_bytes(folder)
    if needed > free:
        raise OutputWriteError(f"{what} needs about {needed / 2**30:,.2f} GiB on the disk of {_nearest_existing(folder)}, "
                               f"which has {free / 2**30:,.2f} GiB free; free space or choose another -o")


def check_output_free(out: Path, overwrite: bool) -> None:
    """Refuse an existing OUT, unless overwriting an empty folder or one that qconvert wrote.

    A folder counts as qconvert's only when its qconvert.json is a valid record
    whose file list accounts for every file present; anything else is refused
    (exit 8) naming the first file that is not accounted for, so nothing of the
    user's is ever deleted.
    """
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; move it away or choose another -o")
    if not overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it, or choose another -o")
    foreign = first_foreign_file(out)
    if foreign is not None:
        name, why = foreign
        raise OutputExistsError(
            f"{out} is not a folder qconvert wrote: {name} {why}; --overwrite replaces only an empty folder or one "
            f"whose {RECORD_NAME} lists every file in it: choose another -o")


def first_foreign_file(folder: Path) -> tuple[str, str] | None:
    """The first file (in path order) under `folder` that its qconvert.json does not account for, and why;
    None when every file is listed in a valid record (or the folder holds no file at all)."""
    from qconvert.formats.record import NO_RECORD, RecordError, read_record

    present, folders = [], []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink() or not path.is_dir():
                present.append((path.relative_to(folder).as_posix(), path))
            else:
                folders.append(path.relative_to(folder).as_posix())
    if not present and not folders:
        return None
    try:
        listed = read_record(folder).files
    except RecordError as err:
        if err.kind == NO_RECORD:
            return min([name for name, _ in present] + folders), f"is not listed in a {RECORD_NAME} (there is none)"
        return RECORD_NAME, f"is not a valid conversion record ({err.kind})"
    for name, path in sorted(present):
        if path.is_symlink() or not path.is_file():
            return name, "is not a regular file"
        if name != RECORD_NAME and name not in listed:
            return name, f"is not listed in its {RECORD_NAME}"
    made = {parent.as_posix() for name in listed for parent in Path(name).parents if parent != Path(".")}
    for name in sorted(folders):
        if name not in made:
            return name, "is a folder qconvert did not make (no file it lists is inside)"
    for name, path in sorted(present):  # last: it reads every file
        if name != RECORD_NAME and sha256_file(path) != listed[name]:
            return name, f"was changed since qconvert wrote it (its sha256 is not the one {RECORD_NAME} lists)"
    return None


def _swap_in(staging: Path, out: Path, committed: Callable[[], None]) -> None:
    """Replace the existing OUT by `staging`; if the second rename fails, the old OUT goes back."""
    old = make_temporary(out, ".old")
    try:
        os.replace(out, old / "previous")
    except OSError:
        discard(old)
        raise
    try:
        os.replace(staging, out)
    except OSError:
        os.replace(old / "previous", out)
        discard(old)
        raise
    committed()
    discard(old)


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside OUT; on success it becomes OUT, on any failure it is removed.

    A full disk, a failed write or a signal therefore never leaves a half-written
    OUT. The folder holds a marker, so a run that was killed outright leaves a
    temporary that the next run writing the same OUT recognises and removes.
    """
    check_output_free(out, overwrite)
    staging = fresh_temporary(out, ".partial", "the output")
    try:
        yield staging
        with interrupts.commit_zone() as committed:
            (staging / TEMPORARY_MARKER).unlink()
            os.chmod(staging, 0o755)  # mkdtemp makes it private; OUT is an ordinary folder
            if out.exists():
                check_output_free(out, overwrite)  # it may have changed while we wrote
                _swap_in(staging, out, committed)
            else:
                os.replace(staging, out)
                committed()
        release(staging)
        interrupts.unregister_temporary(staging)
    except OSError as err:
        discard(staging)
        raise OutputWriteError(
            f"writing {out} failed: {err.strerror or err}; nothing was left behind, free space or fix "
            "permissions and run again"
        ) from None
    except BaseException:
        discard(staging)
        raise


@contextlib.contextmanager
def scratch_folder(out: Path) -> Iterator[Path]:
    """A private temporary folder beside OUT for intermediate files (GPTQ's codes), removed on any exit.

    It carries the same marker as the staging folder, so one left by a killed run is removed by the next.
    """
    scratch = fresh_temporary(out, ".scratch", "a temporary folder")
    try:
        yield scratch
    finally:
        discard(scratch)


def check_file_output_free(out: Path, overwrite: bool, ours: Callable[[Path], bool], kind: str) -> None:
    """Refuse (exit 8) an existing file OUT unless --overwrite is given and `ours(out)` says qconvert wrote it.

    A folder, a link or any file qconvert did not write is never replaced.
    """
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_file():
        raise OutputExistsError(f"{out} exists and is not a file; move it away or choose another -o")
    if not overwrite:
        raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it, or choose another -o")
    if not ours(out):
        raise OutputExistsError(f"{out} is not {kind} qconvert wrote; --overwrite replaces only those: "
                                "choose another -o")


def write_file_atomically(out: Path, write: Callable[[Any], None], recheck: Callable[[], None]) -> None:
    """Write OUT through `write(binary file)` into a temporary folder beside it, then rename it into place.

    A failed write or a signal leaves OUT as it was (absent, or the old file) and
    no temporary; `recheck()` runs again just before the rename, in case OUT
    changed while the file was written.
    """
    staging = fresh_temporary(out, ".partial", "the output")
    try:
        staged = staging / out.name
        with open(staged, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(staged, 0o644)
        with interrupts.commit_zone() as committed:
            recheck()
            os.replace(staged, out)
            committed()
    except OSError as err:
        raise OutputWriteError(f"writing {out} failed: {err.strerror or err}; {out} was left as it was, "
                               "free space or fix permissions and run again") from None
    finally:
        discard(staging)
