"""Resolving MODEL: local folders, a Hub cache built here (HF_HUB_OFFLINE=1), and the Hub's failures."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from hub_cache import COMMIT, build_hub_cache
from qconvert.source import hub
from qconvert.formats.errors import (
    HubUnavailableError,
    InvalidCheckpointError,
    ModelNotFoundError,
    UnsupportedModelError,
    UsageError,
)


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


QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


def test_an_unreachable_hub_is_one_line_within_seconds_and_says_how_to_get_the_model(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    done = subprocess.run([QCONVERT, "quantize", "some-org/some-model", "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 4 and elapsed < 10
    assert done.stderr.splitlines() == [
        f"qconvert: error: the Hub cannot be reached (127.0.0.1:9: Connection refused) and some-org/some-model is "
        f"not in the cache ({tmp_path / 'hf' / 'hub'}); run `hf download some-org/some-model` where the Hub is "
        "reachable and copy its HF_HOME here, or pass a local folder"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_unreachable_hub_still_serves_a_cached_model(source, tmp_path, monkeypatch):
    from hub_cache import build_hub_cache

    build_hub_cache(tmp_path / "hf", "some-org/cached", source)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([QCONVERT, "quantize", "some-org/cached", "-o", str(tmp_path / "out"), "-q"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and (tmp_path / "out" / "qconvert.json").is_file()
