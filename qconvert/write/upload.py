"""Upload a written OUT folder to a Hugging Face Hub model repository (`quantize --upload-repo`).

`check_upload` runs before anything is converted: a repository id the Hub takes, HF_HUB_OFFLINE not set, a token
(exit 2 each). `upload_folder` runs once OUT is complete: the repository is created if missing (private unless
--public), then every file of OUT goes up in one commit, the model card (README.md) included. Every request is
bounded: one probe of the endpoint first (source/hub.py's: a connection and an answer, 3 s each), then
source/hub_http.py's bounded client (a timeout is not retried), with ANSWER_TIMEOUT_S between bytes. The bytes travel over the Hub's HTTP API
(small files inside the commit, the shards through its LFS endpoint), not through hf_xet, whose transfers run
outside that client and its timeouts. A failure after the write is one line saying that OUT is written and the
`hf upload` command that uploads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qconvert import interrupts
from qconvert.formats.errors import HubUnavailableError, QConvertError, UsageError
from qconvert.stages import stage

# Seconds the Hub may take to answer a request once it is sent, or to take the next piece of a file being sent:
# a commit of many files keeps the Hub busy for seconds; silent this long, it is taken as unreachable.
ANSWER_TIMEOUT_S = 60.0
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclasses.dataclass(frozen=True)
class UploadTarget:
    """Where --upload-repo sends OUT: the repository id as given, and whether it is made private."""

    repo: str
    private: bool


@dataclasses.dataclass(frozen=True)
class Upload:
    """What an upload did, or for a dry run would do (`url` None): `quantize --json`'s `upload`."""

    repo: str  # the id the Hub answered (OWNER/NAME; NAME alone is the token owner's)
    private: bool
    url: str | None = None  # the commit's page on the Hub
    commit: str | None = None
    files: int | None = None
    bytes: int | None = None

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the summary."""
        visibility = "private" if self.private else "public"
        if self.url is None:
            return f"a real run would then upload the folder to the Hub repository {self.repo} ({visibility})"
        return (f"uploaded {self.files} files ({self.bytes / 2**20:,.1f} MiB) to the Hub repository {self.repo} "
                f"({visibility}): {self.url}")


def check_upload(repo: str | None, public: bool) -> UploadTarget | None:
    """Before anything is converted: --upload-repo's id is one the Hub takes, the Hub is not switched off
    (HF_HUB_OFFLINE) and a token is set (exit 2 each, one line). None without --upload-repo."""
    if repo is None:
        if public:
            raise UsageError("--public applies to --upload-repo: add --upload-repo OWNER/NAME, or drop --public")
        return None
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise UsageError(f"--upload-repo {repo!r} is not a Hub repository id (OWNER/NAME): {_first_line(err)}"
                         ) from None
    if int(huggingface_hub.__version__.split(".")[0]) < 1:  # set_client_factory, for the time bounds, came in 1.0
        raise UsageError(f"--upload-repo needs huggingface_hub 1.0 or later (this is {huggingface_hub.__version__}):"
                         " pip install -U huggingface_hub")
    if constants.HF_HUB_OFFLINE:
        which = next((v for v in _OFFLINE_VARIABLES if os.environ.get(v, "").strip().upper() in
                      {"1", "ON", "YES", "TRUE"}), _OFFLINE_VARIABLES[0])  # huggingface_hub's reading
        raise UsageError(f"--upload-repo needs the Hub, but {which} is set: unset it, or convert without "
                         "--upload-repo and upload OUT later with `hf upload`")
    with bounded_requests():  # a token from HF_OIDC_RESOURCE is a request to the Hub
        try:
            token = huggingface_hub.get_token()
        except _hub_failures() as err:
            raise HubUnavailableError(f"--upload-repo: the Hub did not give a token ({_what_failed(err)})") from None
    if token is None:
        raise UsageError("--upload-repo needs a Hugging Face token that may write to the repository: set HF_TOKEN "
                         "or run `hf auth login`")
    return UploadTarget(repo, private=not public)


def upload_folder(folder: Path, target: UploadTarget, commit_message: str, *,
                  message: Callable[[str], None] | None = None, progress_bars: bool = False) -> Upload:
    """Every file of the complete `folder` in one commit to `target.repo` (created if missing, private unless
    target says public). An existing public repository is refused for a private upload (exit 2), a Hub that does
    not answer is exit 4, one that refuses the token or the files exit 2; each line says `folder` is written and
    how to upload it. A signal stops the upload (the folder stays)."""
    from huggingface_hub import HfApi

    from qconvert.source.hub import hub_unreachable_reason

    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    unreachable = hub_unreachable_reason()
    if unreachable is not None:
        raise HubUnavailableError(f"the Hub cannot be reached{unreachable}: {_written(folder, target)}")
    if message is not None:
        message(f"uploading {len(files)} files ({size / 2**20:,.1f} MiB) to the Hub repository {target.repo}")
    api = HfApi()
    try:
        with stage("uploading"), interrupts.stoppable_after_commit(), bounded_requests(), _over_http(), \
                _bars(progress_bars):
            repo = api.create_repo(target.repo, private=target.private, exist_ok=True).repo_id
            # create_repo leaves an existing repository as it is: a private upload never goes into a public one.
            private = bool(api.model_info(repo, expand=["private"]).private)
            if target.private and not private:
                raise UsageError(f"the Hub repository {repo} exists and is public, and --upload-repo without "
                                 f"--public uploads into private ones: {folder} is written and complete; choose "
                                 f"another name, or upload it there with `{_command(folder, repo, private=False)}`")
            commit = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message)
    except _hub_failures() + (RuntimeError, ValueError) as err:
        raise _failure(err, folder, target) from None
    return Upload(repo=repo, private=private, url=commit.commit_url, commit=commit.oid, files=len(files),
                  bytes=size)


@contextlib.contextmanager
def bounded_requests() -> Iterator[None]:
    """Inside the block, every huggingface_hub request connects within CONNECT_TIMEOUT_S and waits at most
    ANSWER_TIMEOUT_S between bytes (qconvert.source.hub_http; the Hub takes a while to answer a commit)."""
    from qconvert.source.hub_http import bound_hub_requests, patient

    bound_hub_requests()
    with patient(ANSWER_TIMEOUT_S):
        yield


@contextlib.contextmanager
def _over_http() -> Iterator[None]:
    """huggingface_hub's HTTP path instead of hf_xet's (see the module's doc). The library reads HF_HUB_DISABLE_XET
    into its constants when imported, and asks them at each upload."""
    from huggingface_hub import constants

    before = constants.HF_HUB_DISABLE_XET
    constants.HF_HUB_DISABLE_XET = True
    try:
        yield
    finally:
        constants.HF_HUB_DISABLE_XET = before


@contextlib.contextmanager
def _bars(show: bool) -> Iterator[None]:
    """huggingface_hub's own upload bars on stderr, or none."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hide = not show and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            enable_progress_bars()


def _hub_failures() -> tuple[type[Exception], ...]:
    from huggingface_hub.errors import HfHubHTTPError

    from qconvert.source.hub import transport_errors

    return (HfHubHTTPError,) + transport_errors()


def _hub_cause(err: BaseException) -> BaseException | None:
    """The Hub's answer or the transport failure behind `err`: huggingface_hub wraps a failed LFS upload in a
    RuntimeError and a refused model card in a ValueError."""
    failures = _hub_failures()
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, failures):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _failure(err: Exception, folder: Path, target: UploadTarget) -> QConvertError:
    """One line for a failed upload: 4 where the Hub did not answer or failed itself (5xx, 408, 429), 2 where it
    refused the token, the repository or the files (other 4xx)."""
    from huggingface_hub.errors import HfHubHTTPError

    cause = _hub_cause(err)
    if cause is None:
        raise err  # not the Hub's doing: a bug, exit 70 with its stage
    written = _written(folder, target)
    status = getattr(getattr(cause, "response", None), "status_code", None) if isinstance(cause, HfHubHTTPError) \
        else None
    if status in (401, 403):
        return UsageError(f"the Hub refused the token for {target.repo} ({_what_failed(cause)}): {folder} is "
                          f"written and complete; with a token that may write to {target.repo} (HF_TOKEN, or `hf auth "
                          f"login`), upload it with `{_command(folder, target.repo, target.private)}`")
    if status is not None and 400 <= status < 500 and status not in (408, 429):
        return UsageError(f"the Hub refused the upload to {target.repo} ({_what_failed(cause)}): {written}")
    if status is not None:
        return HubUnavailableError(f"the Hub failed the upload to {target.repo} ({_what_failed(cause)}): {written} "
                                   "once it works again")
    return HubUnavailableError(f"the Hub did not answer the upload to {target.repo} ({_what_failed(cause)}): "
                               f"{written} once it is reachable")


def _what_failed(err: BaseException) -> str:
    """'HTTP 403: <the Hub's message>', or the transport error's type and first line."""
    from qconvert.source.hub_http import HubNotAnswering

    if isinstance(err, HubNotAnswering):
        return f"{err.endpoint} {err.what}: {err.request}"
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        said = getattr(err, "server_message", None) or _first_line(err)
        return f"HTTP {status}: {_first_line(said)}"
    return f"{type(err).__name__}: {_first_line(err)}".rstrip(": ")


def _written(folder: Path, target: UploadTarget) -> str:
    return f"{folder} is written and complete; upload it with `{_command(folder, target.repo, target.private)}`"


def _command(folder: Path, repo: str, private: bool) -> str:
    """huggingface_hub's own command that uploads the folder (creating the repository private, where asked)."""
    return f"hf upload {repo} {shlex.quote(str(folder))}" + (" --private" if private else "")


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0].strip() if lines else ""
