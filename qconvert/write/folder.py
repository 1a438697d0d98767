"""The output folder: staged beside OUT and renamed into place, side files copied, config and qconvert.json written."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qconvert import interrupts
from qconvert.formats.errors import OutputExistsError, OutputWriteError, UsageError
from qconvert.formats.jsonfile import write_json  # noqa: F401  (re-exported: config.json is written with it)
from qconvert.formats.record import RECORD_NAME
from qconvert.formats.safetensors_io import sha256_file

# Inside every temporary folder qconvert makes beside OUT: proof that it is ours (and whose: a pid).
TEMPORARY_MARKER = ".qconvert-temporary"
TEMPORARY_SUFFIXES = (".partial", ".old", ".scratch")
# Tokenizer, generation and sentence-transformers files travel with the weights unchanged.
SIDE_FILE_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "generation_config.json",
    "vocab.txt", "vocab.json", "merges.txt", "*.tiktoken", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "[0-9]_*/*.json",
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


# A temporary beside OUT is named ".<name>.<8 random characters><suffix>" (tempfile.mkdtemp's).
TEMPORARY_NAME_EXTRA = len("..") + 8 + max(map(len, TEMPORARY_SUFFIXES))


def _check_name_length(out: Path, target: Path) -> None:
    """UsageError when OUT's name, or the temporary name it is staged under, is longer than its file system
    takes (it would fail only once the work is done)."""
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        name_max = 255
    length = len(os.fsencode(target.name))
    if length + TEMPORARY_NAME_EXTRA > name_max:
        raise UsageError(f"-o {out}: its name is {length} bytes, and qconvert writes it first under a name "
                         f"{TEMPORARY_NAME_EXTRA} bytes longer, beyond the {name_max} this file system takes; choose "
                         f"a name of at most {name_max - TEMPORARY_NAME_EXTRA} bytes")


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


def _temporary_pattern(out: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(out.name)}\.[A-Za-z0-9_]+({'|'.join(map(re.escape, TEMPORARY_SUFFIXES))})$")


def _make_temporary(out: Path, suffix: str) -> Path:
    """A private folder beside OUT holding the marker (made with signals held back, so it never lacks it).

    The marker is locked (flock) for as long as this process runs: the proof of life another run checks, from
    any PID namespace (another container on a shared volume), before it calls the folder stale."""
    with interrupts.deferred():
        path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=suffix, dir=out.parent))
        interrupts.register_temporary(path)
        marker = path / TEMPORARY_MARKER
        marker.write_text(f"{os.getpid()}\n", encoding="ascii")
        _hold(path, marker)
    return path


# Temporary folder -> the open descriptor of its locked marker (closed when the folder is discarded or kept).
_LOCKS: dict[Path, int] = {}


def _hold(path: Path, marker: Path) -> None:
    try:
        import fcntl

        fd = os.open(marker, os.O_RDONLY)
    except (ImportError, OSError):
        return  # no flock here: the pid alone speaks for the run
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    _LOCKS[path] = fd


def _release(path: Path) -> None:
    fd = _LOCKS.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def _locked_by_a_live_run(marker: Path) -> bool:
    """Whether a running process holds the marker's lock (in this PID namespace or another)."""
    try:
        import fcntl

        fd = os.open(marker, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its run is alive
    finally:
        os.close(fd)  # closing drops the lock taken to look
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temporaries(out: Path) -> list[Path]:
    """Temporary folders beside OUT left by an earlier run that was killed: named like ours, holding our
    marker, made by a process that no longer runs. Nothing else is ever listed."""
    parent, pattern = out.parent, _temporary_pattern(out)
    if not parent.is_dir():
        return []
    stale = []
    for entry in sorted(parent.iterdir()):
        marker = entry / TEMPORARY_MARKER
        if not pattern.match(entry.name) or entry.is_symlink() or not entry.is_dir() or not marker.is_file():
            continue
        try:
            pid = int(marker.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            continue
        # Stale only when nothing holds its lock (a run in another container holds it with a pid that means
        # nothing here) and its pid runs nowhere here (a run of a qconvert that took no lock).
        if pid != os.getpid() and not _locked_by_a_live_run(marker) and not _alive(pid):
            stale.append(entry)
    return stale


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove what `stale_temporaries` finds; returns the folders removed."""
    removed = stale_temporaries(out)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _discard(path: Path) -> None:
    _release(path)
    shutil.rmtree(path, ignore_errors=True)
    interrupts.unregister_temporary(path)


def _swap_in(staging: Path, out: Path, committed: Callable[[], None]) -> None:
    """Replace the existing OUT by `staging`; if the second rename fails, the old OUT goes back."""
    old = _make_temporary(out, ".old")
    try:
        os.replace(out, old / "previous")
    except OSError:
        _discard(old)
        raise
    try:
        os.replace(staging, out)
    except OSError:
        os.replace(old / "previous", out)
        _discard(old)
        raise
    committed()
    _discard(old)


def _fresh_temporary(out: Path, suffix: str, what: str) -> Path:
    """A new marked temporary folder beside OUT, after removing any a killed run left there (exit 9 on failure)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        return _make_temporary(out, suffix)
    except OSError as err:
        raise OutputWriteError(f"cannot create {what} beside {out}: {err.strerror or err}") from None


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside OUT; on success it becomes OUT, on any failure it is removed.

    A full disk, a failed write or a signal therefore never leaves a half-written
    OUT. The folder holds a marker, so a run that was killed outright leaves a
    temporary that the next run writing the same OUT recognises and removes.
    """
    check_output_free(out, overwrite)
    staging = _fresh_temporary(out, ".partial", "the output")
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
        _release(staging)
        interrupts.unregister_temporary(staging)
    except OSError as err:
        _discard(staging)
        raise OutputWriteError(
            f"writing {out} failed: {err.strerror or err}; nothing was left behind, free space or fix "
            "permissions and run again"
        ) from None
    except BaseException:
        _discard(staging)
        raise


@contextlib.contextmanager
def scratch_folder(out: Path) -> Iterator[Path]:
    """A private temporary folder beside OUT for intermediate files (GPTQ's codes), removed on any exit.

    It carries the same marker as the staging folder, so one left by a killed run is removed by the next.
    """
    scratch = _fresh_temporary(out, ".scratch", "a temporary folder")
    try:
        yield scratch
    finally:
        _discard(scratch)


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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        staging = _make_temporary(out, ".partial")
    except OSError as err:
        raise OutputWriteError(f"cannot create the output beside {out}: {err.strerror or err}") from None
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
        _discard(staging)


def _inside_model(path: Path, folder: Path) -> bool:
    """A regular file inside the model folder, or a Hub cache snapshot's link to its own blobs/; a link that
    leads anywhere else (a tokenizer_config.json pointing at /etc/passwd) is not copied."""
    real, root = path.resolve(), folder.resolve()
    if root in real.parents:
        return True
    snapshots = folder.absolute().parent
    return snapshots.name == "snapshots" and (snapshots.parent / "blobs").resolve() in real.parents


def side_files(folder: Path) -> list[str]:
    """Relative paths (sorted) of the tokenizer/generation files in a model folder."""
    found = []
    depth = max(p.count("/") for p in SIDE_FILE_PATTERNS) + 1
    for path in sorted(_files_to_depth(folder, depth)):
        rel = path.relative_to(folder).as_posix()
        if any(side_file_match(rel, p) for p in SIDE_FILE_PATTERNS) and _inside_model(path, folder):
            found.append(rel)
    return found


def side_file_match(rel: str, pattern: str) -> bool:
    """Whether a relative path matches a side-file pattern folder by folder: each `/`-separated part of the
    pattern matches one part of the path (fnmatch's `*` alone crosses `/`: `tokenizer*` took
    `tokenizer_work/.git/config`), and no part of the path is hidden (`.git`, `.cache`)."""
    parts, wanted = rel.split("/"), pattern.split("/")
    return (len(parts) == len(wanted) and not any(part.startswith(".") for part in parts)
            and all(fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted)))


def _files_to_depth(folder: Path, depth: int) -> list[Path]:
    """The regular files of `folder` at most `depth` levels down (no deeper tree is walked)."""
    found, level = [], [folder]
    for _ in range(depth):
        below = []
        for directory in level:
            try:
                entries = list(directory.iterdir())
            except OSError:
                continue
            found += [e for e in entries if e.is_file()]
            below += [e for e in entries if e.is_dir() and not e.is_symlink() and not e.name.startswith(".")]
        level = below
    return found


def copy_side_files(source: Path, out: Path) -> dict[str, str]:
    """Copy the side files byte for byte; returns {relative path: sha256}."""
    hashes = {}
    for rel in side_files(source):
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, target)  # contents only: no timestamps or modes carried over
        os.chmod(target, 0o644)
        hashes[rel] = sha256_file(target)
    return hashes


def source_file_hashes(folder: Path, names: list[str]) -> dict[str, str]:
    """{relative path: sha256} of the input files a conversion read."""
    return {name: sha256_file(folder / name) for name in sorted(set(names))}


def hash_in_background(folder: Path, names: list[str]) -> Callable[[], dict[str, str]]:
    """Start hashing the input files on a second thread (hashlib releases the GIL); call the result to wait.

    The conversion is busy reading and quantizing meanwhile, so on two or more
    cores the input hashes cost little wall time.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["hashes"] = source_file_hashes(folder, names)
        except BaseException as err:  # handed to the caller on result()
            box["error"] = err

    thread = threading.Thread(target=work, name="qconvert-input-sha256", daemon=True)
    thread.start()

    def result() -> dict[str, str]:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["hashes"]

    return result
