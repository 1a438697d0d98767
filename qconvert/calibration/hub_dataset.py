"""A Hub dataset as calibration reads it: the hf://datasets/... address, the repository's files at one commit (listed
by the Hub, or found in the cache alone offline), and each file fetched through huggingface_hub's cache only when it
is first read."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from qconvert.formats.errors import HubUnavailableError, ModelNotFoundError, UsageError

# A revision may be a special ref with slashes (refs/convert/parquet, refs/pr/1), as huggingface_hub's HfFileSystem
# reads them, or any other name without one; %2F-quoted slashes are read as slashes.
_ADDRESS = re.compile(r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                      r"(?:@(?P<rev>refs/convert/\w+|refs/pr/[0-9]+|[^/]+))?(?:/(?P<path>.*))?$", re.ASCII)
FORMS = ("hf://datasets/<owner>/<name>[@revision] (a whole dataset) or "
         "hf://datasets/<owner>/<name>[@revision]/<file.txt|file.jsonl>")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclasses.dataclass(frozen=True)
class DatasetAddress:
    """hf://datasets/OWNER/NAME[@REVISION][/PATH]: PATH None means the dataset as a whole."""

    repo: str
    revision: str | None
    path: str | None


@dataclasses.dataclass(frozen=True)
class DatasetSelection:
    """What of a whole dataset calibration reads: --calib-config, --calib-split, --calib-column (None: not given),
    and a commit that overrides the address's revision (verify reading the recorded windows again)."""

    config: str | None = None
    split: str | None = None
    column: str | None = None
    commit: str | None = None

    FLAGS = (("config", "--calib-config"), ("split", "--calib-split"), ("column", "--calib-column"))

    def given(self) -> list[str]:
        """The flags given, as the command line spells them."""
        return [flag for field, flag in self.FLAGS if getattr(self, field) is not None]


def recorded_selection(record: dict[str, Any] | None) -> DatasetSelection | None:
    """The selection that reads a calibration record's dataset again, at its recorded commit (None: no dataset)."""
    dataset = (record or {}).get("dataset")
    if not isinstance(dataset, dict):
        return None
    return DatasetSelection(dataset.get("config"), dataset.get("split"), dataset.get("column"), dataset.get("revision"))


def parse_address(address: str) -> DatasetAddress:
    """The parts of an hf://datasets/... address; UsageError for one that does not parse or climbs out with '..'."""
    match = _ADDRESS.match(address)
    revision = unquote(match["rev"]) if match and match["rev"] else None
    path = match["path"] if match and match["path"] else None
    if match is None or _climbs(path) or ".." in (revision or "").split("/"):
        raise UsageError(f"cannot read calibration address {address!r}; write {FORMS}")
    return DatasetAddress(match["repo"], revision, path)



def _climbs(path: str | None) -> bool:
    """Whether a file path inside a repository is absolute, climbs out, or has an empty name (a//b)."""
    return path is not None and any(name in ("", ".", "..") or "\\" in name for name in path.split("/"))


def is_whole_dataset(calib: str | None) -> bool:
    """Whether `--calib` names a whole Hub dataset (no file path)."""
    if not calib or not calib.startswith("hf://datasets/"):
        return False
    try:
        return parse_address(calib).path is None
    except UsageError:
        return False


def download_dataset_file(address: str) -> Path:
    """Fetch hf://datasets/<owner>/<name>[@revision]/<path> with huggingface_hub; the local path."""
    parsed = parse_address(address)
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from qconvert.source.hub import hub_offline, hub_unreachable_reason
    from qconvert.source.hub_http import bound_hub_requests

    bound_hub_requests()
    # One short probe instead of huggingface_hub's retries: unreachable means the cache alone.
    cache_only = not hub_offline() and hub_unreachable_reason() is not None
    try:
        local = huggingface_hub.hf_hub_download(
            repo_id=parsed.repo, filename=parsed.path, repo_type="dataset", revision=parsed.revision,
            **({"local_files_only": True} if cache_only else {}))
    except (hub_errors.LocalEntryNotFoundError, OSError) as err:  # before EntryNotFoundError, its base
        raise HubUnavailableError(f"cannot download {address}: the Hub is unreachable and the file "
                                  f"is not cached ({type(err).__name__}); pass a local file or "
                                  "'--calib builtin'") from None
    except hub_errors.HFValidationError as err:
        raise UsageError(f"cannot read calibration address {address!r} ({one_line(err)}); write {FORMS}") from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.EntryNotFoundError,
            hub_errors.RevisionNotFoundError) as err:
        raise ModelNotFoundError(f"calibration file {address} not found on the Hub "
                                 f"({type(err).__name__}); check the repository and path") from None
    return Path(local)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A dataset repository at one commit: its file paths, fetched one by one when read."""

    repo: str
    commit: str
    paths: tuple[str, ...]
    cache_only: str | None = None  # why only the cache is read (offline, or the probe's answer); None: the Hub

    @property
    def where(self) -> str:
        """What the messages about its files add: where they were looked for."""
        return f" in the cached snapshot {self.commit[:12]}" if self.cache_only else ""

    def fetch(self, path: str) -> Path:
        """The local file of `path`, downloaded into the Hub cache if it is not there (the cache alone offline)."""
        from huggingface_hub import errors as hub_errors
        from huggingface_hub import hf_hub_download

        from qconvert.source.hub import hub_cache_dir, transport_errors

        try:
            return Path(hf_hub_download(self.repo, path, repo_type="dataset", revision=self.commit,
                                        cache_dir=hub_cache_dir(), local_files_only=bool(self.cache_only)))
        except hub_errors.LocalEntryNotFoundError:
            raise HubUnavailableError(f"{path} of Hub dataset {self.repo} is not cached and the Hub cannot be "
                                      f"reached{self.cache_only or ''}") from None
        except (hub_errors.HfHubHTTPError, *transport_errors()) as err:
            raise HubUnavailableError(f"cannot download {path} of Hub dataset {self.repo}: "
                                      f"{one_line(err)}") from None

    def card_metadata(self) -> dict[str, Any] | None:
        """The YAML block of the dataset's README.md (its `configs:`), or None when it has none."""
        if "README.md" not in self.paths:
            return None
        import yaml  # huggingface_hub's own dependency, which reads the card
        from huggingface_hub import metadata_load

        path = self.fetch("README.md")
        try:
            return metadata_load(path)
        except (yaml.YAMLError, ValueError) as err:  # ValueError: not UTF-8, or a block that is not a mapping
            raise UsageError(f"the README.md of Hub dataset {self.repo} has a YAML block that cannot be read "
                             f"({one_line(err)})") from None


def open_snapshot(repo: str, revision: str | None) -> Snapshot:
    """The dataset's files at `revision` (default main): listed by the Hub, or, with HF_HUB_OFFLINE set or the Hub
    unreachable (one short probe), those of the cached snapshot."""
    from qconvert.source.hub import hub_offline, hub_unreachable_reason
    from qconvert.source.hub_http import bound_hub_requests

    bound_hub_requests()  # every later request of the snapshot's (the listing, each file) is bounded
    if hub_offline():
        return _cached_snapshot(repo, revision, " (HF_HUB_OFFLINE is set)")
    unreachable = hub_unreachable_reason()
    if unreachable is not None:
        return _cached_snapshot(repo, revision, unreachable)
    return _listed_snapshot(repo, revision)


def _listed_snapshot(repo: str, revision: str | None) -> Snapshot:
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hub_errors

    from qconvert.source.hub import transport_errors

    at = f" at revision {revision}" if revision else ""
    try:
        info = HfApi().dataset_info(repo, revision=revision)
    except hub_errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"Hub dataset {repo} has no revision {revision}; check the @revision of "
                                 "--calib") from None
    except hub_errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f"Hub dataset {repo} not found (or private/gated); check the name, or set HF_TOKEN "
                                 "for a private dataset") from None
    except hub_errors.HFValidationError as err:
        raise UsageError(f"cannot read calibration address hf://datasets/{repo} ({one_line(err)})") from None
    except hub_errors.HfHubHTTPError as err:
        if getattr(err.response, "status_code", None) in (401, 403):
            raise ModelNotFoundError(f"Hub dataset {repo} needs access rights; set HF_TOKEN to a token that has "
                                     "them") from None
        raise HubUnavailableError(f"the Hub cannot list dataset {repo}{at}: {one_line(err)}") from None
    except transport_errors() as err:
        raise HubUnavailableError(f"the Hub cannot be reached for dataset {repo}{at}: {one_line(err)}") from None
    return Snapshot(repo, str(info.sha), tuple(sorted(s.rfilename for s in info.siblings or ())))


def _cached_snapshot(repo: str, revision: str | None, why: str) -> Snapshot:
    """The cached snapshot of `revision`, found as huggingface_hub lays its cache out (refs/REVISION holds the
    commit; snapshots/COMMIT the files). Not snapshot_download(local_files_only=True): where its cached listing of
    the repository shows files not downloaded it refuses the snapshot, while calibration needs only the split's
    first files; each file is still read through hf_hub_download."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    from qconvert.source.hub import hub_cache_dir

    root = Path(hub_cache_dir() or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="dataset")
    name = revision or "main"
    ref = root / "refs" / name
    commit = name if _COMMIT.match(name) else (ref.read_text().strip() if ref.is_file() else None)
    folder = root / "snapshots" / commit if commit else None
    if folder is None or not folder.is_dir():
        at = f" at revision {revision}" if revision else ""
        download = f"hf download {repo} --repo-type dataset" + (f" --revision {revision}" if revision else "")
        raise HubUnavailableError(f"the Hub cannot be reached{why} and dataset {repo}{at} is not in the cache "
                                  f"({root.parent}); run `{download}` where the Hub is reachable and copy its "
                                  "HF_HOME here, or pass a local file")
    paths = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return Snapshot(repo, commit, tuple(paths), why)


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and its message's words."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
