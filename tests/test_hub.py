"""Resolving MODEL: local folders, a Hub cache built here (HF_HUB_OFFLINE=1), and the Hub's failures."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from qconvert.source import hub
from qconvert.formats.errors import (
    HubUnavailableError,
    InvalidCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
    UsageError,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(hf_home: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay `source`'s files out as huggingface_hub caches them: blobs/, snapshots/<commit>/ links, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.rglob("*")):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_local_folder_resolves_as_it_is(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "m")
    resolved = hub.resolve_model(str(folder))
    assert resolved.folder == folder and not resolved.is_hub and resolved.commit is None
    assert resolved.config["architectures"] == ["LlamaForCausalLM"]


def test_missing_folder_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        hub.resolve_model(str(tmp_path / "nope"))


def test_revision_on_a_local_folder_is_a_usage_error(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "m")
    with pytest.raises(UsageError):
        hub.resolve_model(str(folder), revision="v1")


def test_hub_id_resolves_from_the_cache_offline(tmp_path, hf_home):
    source = make_llama_checkpoint(tmp_path / "src", shards=2)
    (source / "tokenizer.json").write_text("{}")
    (source / "pytorch_model.bin").write_bytes(b"pickle, never fetched")
    snapshot = build_hub_cache(hf_home, "org/tiny-llama", source)
    resolved = hub.resolve_model("org/tiny-llama")
    assert resolved.is_hub and resolved.commit == COMMIT and resolved.model_id == "org/tiny-llama"
    assert resolved.folder == snapshot
    assert (resolved.folder / "model.safetensors.index.json").exists()


def test_hub_id_not_cached_offline_is_hub_unavailable(hf_home):
    with pytest.raises(HubUnavailableError, match="not in the cache"):
        hub.resolve_model("org/not-cached")


@pytest.mark.parametrize("repo_id,architecture,pickles,match", [
    # The cache holds only config.json: the refusal must come from it alone, before any weights.
    ("org/gpt", "GPT2LMHeadModel", False, "GPT2LMHeadModel.*LlamaForCausalLM"),
    ("org/pickles", "LlamaForCausalLM", True, "pickled weights"),
], ids=["unsupported_architecture_fails_before_weights", "checkpoint_with_only_pickles"])
def test_hub_checkpoint_is_refused(tmp_path, hf_home, repo_id, architecture, pickles, match):
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    if pickles:
        (source / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    build_hub_cache(hf_home, repo_id, source)
    with pytest.raises(UnsupportedModelError, match=match):
        hub.resolve_model(repo_id)


def test_local_folder_with_only_pickles_is_refused(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(UnsupportedModelError, match="pytorch_model.bin"):
        hub.resolve_model(str(folder))


@pytest.mark.parametrize("text", [None, "{not json", "[1, 2]"])
def test_missing_or_invalid_config_is_invalid_checkpoint(tmp_path, text):
    folder = make_llama_checkpoint(tmp_path / "m")
    if text is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(text)
    with pytest.raises(InvalidCheckpointError, match="config.json"):
        hub.resolve_model(str(folder))


def test_hub_library_errors_are_mapped(monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors as hf

    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/x/y"))
    cases = [
        (hf.RepositoryNotFoundError("Repository Not Found", response=response), ModelNotFoundError),
        (hf.RevisionNotFoundError("Revision Not Found", response=response), ModelNotFoundError),
        (httpx2.ConnectError("connection refused"), HubUnavailableError),
        (hf.LocalEntryNotFoundError("not cached"), HubUnavailableError),
    ]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for raised, expected in cases:
        def fake_download(*args, _raised=raised, **kwargs):
            raise _raised
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
        with pytest.raises(expected):
            hub.resolve_model("org/name")
