"""Resolve MODEL (a local folder or a Hugging Face Hub id) to a folder of config, safetensors and tokenizer files.

For a Hub id, config.json is fetched first and the architecture is checked
against the registry before any weight is downloaded; then only safetensors,
JSON and tokenizer files are fetched. Pickled weights (*.bin, *.pt) are never
downloaded or read. HF_TOKEN, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE are read
when a model is resolved, not when the module is imported.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Callable

from qconvert.formats.errors import (
    HubUnavailableError,
    InvalidCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
    UsageError,
)
from qconvert.formats.jsonfile import read_config
from qconvert.source.hub_http import HubNotAnswering, bound_hub_requests

# What a conversion needs from a repository; everything else (pickles, ONNX, images) stays remote.
ALLOW_PATTERNS = (
    "*.safetensors", "*.json",
    "tokenizer.model", "*.tiktoken", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Seconds the one reachability probe of the Hub may take (huggingface_hub would retry for ~25 s).
PROBE_TIMEOUT_SECONDS = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are on disk and where they came from."""

    folder: Path
    model_id: str
    revision: str | None
    commit: str | None
    is_hub: bool
    config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    # The model family the architecture check found in config.json (None where it let an unknown one through):
    # the command's one lookup, which opening the source takes as it is.
    family: Any = dataclasses.field(default=None, compare=False)


def check_weights_are_safetensors(folder: Path, where: str) -> None:
    """Refuse a checkpoint without *.safetensors weights, naming pickles when that is all it has."""
    names = [p.name for p in Path(folder).rglob("*") if p.is_file()]
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UnsupportedModelError(
            f"{where} has only pickled weights ({', '.join(pickles[:3])}); qconvert reads safetensors only: "
            "convert them to safetensors first"
        )
    raise InvalidCheckpointError(f"{where} has no *.safetensors weights")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (read now, not when huggingface_hub was imported)."""
    return _env_true("HF_HUB_OFFLINE")


def hub_cache_dir() -> str | None:
    """The Hub cache HF_HUB_CACHE or HF_HOME name now (None: huggingface_hub's default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def _looks_like_path(model: str) -> bool:
    return model.startswith((".", "/", "~", "\\")) or model.count("/") > 1 or not _HUB_ID.match(model)


def _hub_error(err: Exception, model_id: str, revision: str | None) -> Exception:
    """Map a huggingface_hub failure to ModelNotFoundError / HubUnavailableError / InvalidCheckpointError."""
    from huggingface_hub import errors as hf

    rev = f" at revision {revision}" if revision else ""
    if isinstance(err, hf.RevisionNotFoundError):
        return ModelNotFoundError(f"Hub model {model_id} has no revision {revision}; check --revision")
    if isinstance(err, hf.RepositoryNotFoundError):
        return ModelNotFoundError(
            f"Hub model {model_id} not found (or private/gated); check the id, or set HF_TOKEN for a private model"
        )
    if isinstance(err, hf.LocalEntryNotFoundError):
        return HubUnavailableError(_not_cached_message(model_id, revision))
    if isinstance(err, hf.EntryNotFoundError):
        return InvalidCheckpointError(f"Hub model {model_id}{rev} has no config.json; it is not a transformers checkpoint")
    if isinstance(err, HubNotAnswering):
        return HubUnavailableError(f"the Hub stopped answering while {model_id}{rev} was fetched: {err.endpoint} "
                                   f"{err.what} ({err.request}); try again, or pass a local folder")
    if isinstance(err, hf.HFValidationError):
        return ModelNotFoundError(f"{model_id} is neither an existing folder nor a valid Hub id")
    if isinstance(err, hf.HfHubHTTPError) and getattr(err.response, "status_code", None) in (401, 403):
        return ModelNotFoundError(f"Hub model {model_id} needs access rights; set HF_TOKEN to a token that has them")
    return HubUnavailableError(f"the Hub cannot be reached for {model_id}{rev}: {type(err).__name__}: {err}".splitlines()[0])


def _not_cached_message(model_id: str, revision: str | None, why: str = "") -> str:
    rev = f" at revision {revision}" if revision else ""
    download = f"hf download {model_id}" + (f" --revision {revision}" if revision else "")
    return (f"the Hub cannot be reached{why or ' (or HF_HUB_OFFLINE is set)'} and {model_id}{rev} is not in the "
            f"cache ({hub_cache_dir() or 'the default HF_HOME'}); run `{download}` where the Hub is reachable "
            "and copy its HF_HOME here, or pass a local folder")


def quiet_hub_logging(quiet: bool) -> None:
    """Keep huggingface_hub's own log lines (retries, warnings) off stderr, or let them through (--verbose)."""
    import logging
    import warnings

    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL + 1 if quiet else logging.NOTSET)
    if quiet:
        warnings.filterwarnings("ignore", module=r"huggingface_hub(\..*)?$")


def hub_unreachable_reason(endpoint: str | None = None, timeout: float = PROBE_TIMEOUT_SECONDS) -> str | None:
    """Probe the Hub endpoint once (one TCP connect, `timeout` seconds); None if reachable, else why not.

    Behind a proxy the endpoint is not dialled directly, so no probe is made there.
    """
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None
    if endpoint is None:
        from huggingface_hub import constants

        endpoint = constants.ENDPOINT
    url = urlsplit(endpoint)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        sock = socket.create_connection((url.hostname, port), timeout=timeout)
    except OSError as err:
        return f" ({url.hostname}:{port}: {err.strerror or type(err).__name__})"
    return _unanswered_reason(sock, url, port, timeout)


def _unanswered_reason(sock, url, port: int, timeout: float) -> str | None:
    """Whether the server that accepted `sock` answers within `timeout` (a TLS handshake, or an HTTP reply):
    None if so, else why not."""
    import socket

    # A server that accepts and never answers would hold every later request to huggingface_hub's timeouts and
    # retries (minutes): the probe waits for an answer too, within the same bound.
    try:
        with sock:
            if url.scheme == "https":
                import ssl

                # Only whether it answers: trust is huggingface_hub's to check (its CA settings, a proxy's).
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
                try:
                    with context.wrap_socket(sock, server_hostname=url.hostname):
                        return None  # the TLS handshake is an answer
                except ssl.SSLError:
                    return None  # it answered, in a way the real client will judge
            sock.sendall(f"HEAD / HTTP/1.1\r\nHost: {url.hostname}\r\nConnection: close\r\n\r\n".encode())
            if not sock.recv(1):
                return f" ({url.hostname}:{port} closed the connection without an answer)"
            return None
    except socket.timeout:
        return f" ({url.hostname}:{port} accepted the connection but did not answer within {timeout:g} s)"
    except OSError as err:
        return f" ({url.hostname}:{port}: {err.strerror or type(err).__name__})"


def transport_errors() -> tuple[type[Exception], ...]:
    """What a request that got no answer raises: the HTTP client under huggingface_hub differs by release
    (httpx2, httpx, requests)."""
    errors: list[type[Exception]] = [ConnectionError, TimeoutError]
    for module, attr in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException")):
        try:
            errors.append(getattr(__import__(module), attr))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _hub_failures() -> tuple[type[Exception], ...]:
    """What a huggingface_hub call may raise for a model it cannot fetch (its own errors and the transport's)."""
    from huggingface_hub import errors as hf

    return (hf.HfHubHTTPError, hf.EntryNotFoundError, hf.HFValidationError,
            hf.OfflineModeIsEnabled) + transport_errors()


def _resolve_hub(model_id: str, revision: str | None, check_architecture=None) -> ResolvedModel:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub import errors as hf

    offline = hub_offline()
    cache_dir = hub_cache_dir()
    hub_failures = _hub_failures()
    bound_hub_requests()
    unreachable = None if offline else hub_unreachable_reason()
    if unreachable is not None:
        return _resolve_cached_or_stop(model_id, revision, cache_dir, check_architecture, unreachable)
    try:
        config_path = Path(hf_hub_download(model_id, "config.json", revision=revision,
                                           cache_dir=cache_dir, local_files_only=offline))
    except HubNotAnswering as err:
        # The Hub answered the probe, then stopped answering: the cache, as when it cannot be reached.
        return _resolve_cached_or_stop(model_id, revision, cache_dir, check_architecture,
                                       f" ({err.endpoint} {err.what}: {err.request})")
    except hub_failures as err:
        raise _hub_error(err, model_id, revision) from None
    folder = config_path.parent
    commit = folder.name  # cache layout: snapshots/<commit>/config.json
    config = read_config(folder)
    family = check_architecture(config)  # unsupported -> error before a single weight byte moves
    try:
        if not offline:
            _refuse_pickles_only(model_id, HfApi().list_repo_files(model_id, revision=commit))
        folder = Path(snapshot_download(model_id, revision=commit, cache_dir=cache_dir,
                                        allow_patterns=list(ALLOW_PATTERNS), local_files_only=offline))
    except hub_failures as err:
        raise _hub_error(err, model_id, revision) from None
    check_weights_are_safetensors(folder, f"Hub model {model_id}")
    return ResolvedModel(folder=folder, model_id=model_id, revision=revision, commit=commit,
                         is_hub=True, config=config, family=family)


def _resolve_cached_or_stop(model_id: str, revision: str | None, cache_dir: str | None, check_architecture,
                            why: str) -> ResolvedModel:
    """The model from the cache alone, the Hub being unreachable (`why`); HubUnavailableError when not cached."""
    from huggingface_hub import errors as hf

    try:
        return _resolve_cached(model_id, revision, cache_dir, check_architecture)
    except hf.LocalEntryNotFoundError:
        raise HubUnavailableError(_not_cached_message(model_id, revision, why)) from None
    except _hub_failures() as err:
        raise _hub_error(err, model_id, revision) from None


def _refuse_pickles_only(model_id: str, remote_files: list[str]) -> None:
    """UnsupportedModelError for a Hub model whose weights are only pickles (never downloaded, never loaded)."""
    if not any(f.endswith(".safetensors") for f in remote_files):
        pickles = sorted(f for f in remote_files if f.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise UnsupportedModelError(
                f"Hub model {model_id} has only pickled weights ({', '.join(pickles[:3])}); "
                "qconvert reads safetensors only"
            )


def _resolve_cached(model_id: str, revision: str | None, cache_dir: str | None,
                    check_architecture=None) -> ResolvedModel:
    """A Hub id from the local cache alone (the Hub is unreachable)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    config_path = Path(hf_hub_download(model_id, "config.json", revision=revision, cache_dir=cache_dir,
                                       local_files_only=True))
    config = read_config(config_path.parent)
    family = check_architecture(config)
    commit = config_path.parent.name
    folder = Path(snapshot_download(model_id, revision=commit, cache_dir=cache_dir,
                                    allow_patterns=list(ALLOW_PATTERNS), local_files_only=True))
    check_weights_are_safetensors(folder, f"Hub model {model_id}")
    return ResolvedModel(folder=folder, model_id=model_id, revision=revision, commit=commit,
                         is_hub=True, config=config, family=family)


def known_family(config: dict) -> object:
    """The family config.json names (UnsupportedModelError otherwise); the registry, which builds models with
    JAX, is imported here, so a MODEL that is not there fails without it."""
    from qconvert.models.registry import family_for

    return family_for(config)


def check_model_argument(model: str) -> None:
    """What MODEL's words alone refuse, before anything is read or imported: an empty one, a broken link, a file,
    and a path that is not there (anything not path-shaped is a Hub id)."""
    if not model.strip():
        raise UsageError("MODEL is empty; give a folder holding config.json and the safetensors, or a Hub id "
                         "(owner/name)")
    path = Path(model).expanduser()
    if path.is_symlink() and not path.exists():
        raise ModelNotFoundError(f"{model} is a symbolic link that leads nowhere (a loop, or a target that does "
                                 "not exist); give the model's folder itself")
    if path.exists() and not path.is_dir():
        raise ModelNotFoundError(f"{model} is a file; give the folder that holds config.json and the safetensors")
    if not path.exists() and _looks_like_path(model):
        raise ModelNotFoundError(f"no such folder: {model}")


def resolve_model(model: str, revision: str | None = None, *,
                  check_architecture: Callable[[dict], object] | None = None) -> ResolvedModel:
    """A local folder as it is, or a Hub id downloaded (config first) into the Hugging Face cache.

    `check_architecture(config)` raises for a model that cannot be converted, before any
    weight is fetched (default: the architecture must be a known family); what it returns
    (the family) is kept as the ResolvedModel's `family`.
    """
    check_architecture = check_architecture or known_family
    check_model_argument(model)
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise UsageError(f"--revision {revision} applies to Hub ids, but {model} is a local folder")
        config = read_config(path)
        family = check_architecture(config)
        check_weights_are_safetensors(path, str(model))
        return ResolvedModel(folder=path, model_id=str(model), revision=None, commit=None,
                             is_hub=False, config=config, family=family)
    return _resolve_hub(model, revision, check_architecture)
