"""`quantize --upload-repo`: OUT goes to a Hub repository in one commit, judged by a Hub on 127.0.0.1 that records
what huggingface_hub sends (tests/hub_server.py); what it refuses is refused before converting; a failure after
the write is one line that leaves OUT complete and says how to upload it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree
from hub_server import FakeHub, SilentHub

REPO = "someone/tiny-int8"
TOKEN = "hf_fake_token_for_the_test_hub"
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("upload") / "src")


@pytest.fixture(scope="module")
def reference(source, tmp_path_factory) -> dict:
    """The folder a conversion for REPO writes, uploading nothing: what OUT must hold after any upload, failed or
    not (its card loads from REPO)."""
    from qconvert.convert import convert
    from qconvert.options import ConvertOptions

    out = tmp_path_factory.mktemp("reference") / "out"
    convert(str(source), out, ConvertOptions(card_repo=REPO))
    return tree(out)


@pytest.fixture
def hub():
    server = FakeHub()
    yield server
    server.close()


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "from qconvert.cli.entry import main; main()", *args]


def environment(endpoint: str | None, token: str | None, home: Path | None = None) -> dict[str, str]:
    """A child's environment with huggingface_hub pointed at `endpoint`: no HF_* variable of this machine (no
    stored token: HF_HOME is `home`), no proxy between it and 127.0.0.1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE")) and k not in PROXIES}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_DISABLE_TELEMETRY="1")
    if endpoint is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = endpoint
    if home is not None:
        env["HF_HOME"] = str(home)
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def quantize(source: Path, out: Path, endpoint: str | None, *args: str, token: str | None = TOKEN,
             timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(command(["quantize", str(source), "-o", str(out), *args]),
                          env=environment(endpoint, token, out.parent / "hf-home"), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def online(monkeypatch, hub, tmp_path):
    """In this process: huggingface_hub aimed at the test Hub (it read HF_ENDPOINT and HF_HUB_OFFLINE when
    imported; the conftest sets HF_HUB_OFFLINE), with a token and no stored one."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    for name in (*PROXIES, "HF_OIDC_RESOURCE", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return hub


@pytest.fixture
def never_converts(monkeypatch):
    """quantize may not reach the conversion: it fails the test if it does."""
    import qconvert.convert

    def convert(*args, **kwargs):
        raise AssertionError("quantize converted before refusing")

    monkeypatch.setattr(qconvert.convert, "convert", convert)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("qconvert: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_out_goes_up_private_in_one_commit_of_every_file_with_the_token(source, reference, hub, tmp_path):
    out = tmp_path / "out"
    done = quantize(source, out, hub.url, "--upload-repo", REPO, "--json")
    assert done.returncode == 0, done.stderr

    (create,) = [r for r in hub.requests if hub.kind_of(r.method, r.path) == "create"]
    body = create.json()
    assert (body["organization"], body["name"]) == ("someone", "tiny-int8")
    assert body.get("visibility") == "private" or body.get("private") is True
    (commit,) = hub.commits
    local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert commit.repo == REPO and "README.md" in local
    # The card uploaded is the repository's: its title and its load snippets name REPO, not a local folder.
    card = local["README.md"].decode()
    assert f"# {REPO} (int8)" in card and f'from_pretrained("{REPO}")' in card and f'LLM(model="{REPO}")' in card
    assert sorted(commit.files) == sorted(local)
    assert {path: sha256(data) for path, data in commit.files.items()} == {p: sha256(d) for p, d in local.items()}
    # The shards went through LFS: the commit names each by the sha256 of the bytes PUT for it.
    assert set(commit.lfs) == {p for p in local if p.endswith(".safetensors")}
    assert all(oid == sha256(local[path]) and size == len(local[path]) for path, (oid, size) in commit.lfs.items())
    assert tree(out) == reference
    to_hub = [r for r in hub.requests if r.path.startswith("/api/") or ".git/" in r.path]
    to_hub = [r for r in to_hub if not r.path.startswith("/api/agent-harnesses")]  # anonymous by design
    assert len(to_hub) >= 4
    assert all({k.lower(): v for k, v in r.headers.items()}.get("authorization") == f"Bearer {TOKEN}" for r in to_hub)

    summary = json.loads(done.stdout)
    oid = commit_oid(hub)
    assert summary["upload"] == {"repo": REPO, "private": True, "url": f"{hub.url}/{REPO}/commit/{oid}",
                                 "commit": oid, "files": len(local), "bytes": sum(map(len, local.values()))}
    assert "uploaded" in summary["phases"]


def commit_oid(hub: FakeHub) -> str:
    (request,) = [r for r in hub.requests if hub.kind_of(r.method, r.path) == "commit"]
    return hashlib.sha1(request.body).hexdigest()


def test_public_makes_a_public_repository_and_the_summary_says_where(source, online, tmp_path, capsys):
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO,
                                "--public"], capsys)
    assert code == 0, stderr
    (create,) = [r for r in online.requests if online.kind_of(r.method, r.path) == "create"]
    assert create.json().get("visibility") == "public" or create.json().get("private") is False
    assert online.repos == {REPO: False}
    (line,) = [line for line in stdout.splitlines() if line.startswith("uploaded ")]
    assert f"to the Hub repository {REPO} (public): {online.url}/{REPO}/commit/{commit_oid(online)}" in line


def test_an_existing_private_repository_takes_the_upload(source, online, tmp_path, capsys):
    online.repos[REPO] = True
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO, "-q"],
                          capsys)
    assert code == 0, stderr
    assert [c.repo for c in online.commits] == [REPO]


def test_an_existing_public_repository_is_not_uploaded_into_without_public(source, reference, online, tmp_path,
                                                                           capsys):
    online.repos[REPO] = False
    out = tmp_path / "out"
    code, _, stderr = run(["quantize", str(source), "-o", str(out), "--upload-repo", REPO], capsys)
    assert code == 2
    line = error_line(stderr)
    assert f"{REPO} exists and is public" in line and line.endswith(f"`hf upload {REPO} {out}`")
    assert not online.commits and "preupload" not in {online.kind_of(r.method, r.path) for r in online.requests}
    assert tree(out) == reference


def test_no_token_is_refused_before_converting(source, online, never_converts, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO],
                               capsys)
    assert code == 2 and stdout == ""
    line = error_line(stderr)
    assert "HF_TOKEN" in line and "`hf auth login`" in line
    assert not (tmp_path / "out").exists() and not online.requests


def test_no_token_is_refused_in_a_fresh_process_within_seconds(source, tmp_path):
    """The stored token is looked for too (HF_HOME here is empty), and nothing is computed: no calibration."""
    started = time.monotonic()
    done = quantize(source, tmp_path / "out", "http://127.0.0.1:9", "--upload-repo", REPO, "--scheme", "w8a8",
                    token=None)
    assert done.returncode == 2, done.stderr
    assert "set HF_TOKEN or run `hf auth login`" in error_line(done.stderr)
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("repo", ["not a repo", "a/b/c", "someone/tiny--int8", "someone/x.git", ""])
def test_a_repository_id_the_hub_refuses_is_exit_2_before_converting(source, online, never_converts, tmp_path,
                                                                     capsys, repo):
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", repo], capsys)
    assert code == 2
    assert f"--upload-repo {repo!r} is not a Hub repository id" in error_line(stderr)
    assert not (tmp_path / "out").exists() and not online.requests


def test_offline_mode_is_refused_before_converting(source, online, never_converts, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO], capsys)
    assert code == 2
    assert "--upload-repo needs the Hub, but HF_HUB_OFFLINE is set" in error_line(stderr)
    assert not (tmp_path / "out").exists() and not online.requests


def test_public_without_upload_repo_is_a_usage_error(source, never_converts, tmp_path, capsys):
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--public"], capsys)
    assert code == 2 and "--public applies to --upload-repo" in error_line(stderr)


def test_a_huggingface_hub_before_1_0_is_refused_before_converting(source, online, never_converts, tmp_path, capsys,
                                                                   monkeypatch):
    """Before 1.0 huggingface_hub had no set_client_factory, through which every request gets its time bound."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "__version__", "0.36.0")
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO], capsys)
    assert code == 2 and "--upload-repo needs huggingface_hub 1.0 or later" in error_line(stderr)


def test_a_dry_run_checks_the_token_and_says_where_it_would_upload(source, online, tmp_path, capsys, monkeypatch):
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO,
                                "--dry-run", "--json"], capsys)
    assert code == 0, stderr
    assert json.loads(stdout)["upload"] == {"repo": REPO, "private": True, "url": None, "commit": None,
                                            "files": None, "bytes": None}
    assert not online.requests and not (tmp_path / "out").exists()
    monkeypatch.delenv("HF_TOKEN")
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--upload-repo", REPO,
                           "--dry-run"], capsys)
    assert code == 2 and "HF_TOKEN" in error_line(stderr)


@pytest.mark.parametrize("kind, status, code, said", [
    ("commit", 403, 2, "the Hub refused the token for someone/tiny-int8 (HTTP 403: refused by the test Hub"),
    ("create", 401, 2, "the Hub refused the token for someone/tiny-int8 (HTTP 401: refused by the test Hub"),
    ("batch", 413, 2, "the Hub refused the upload to someone/tiny-int8 (HTTP 413: refused by the test Hub"),
    ("commit", 503, 4, "the Hub failed the upload to someone/tiny-int8 (HTTP 503: refused by the test Hub"),
])
def test_a_refused_upload_is_one_line_and_out_stays_complete(source, reference, online, tmp_path, capsys, kind,
                                                             status, code, said):
    online.refuse[kind] = status
    out = tmp_path / "out"
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(out), "--upload-repo", REPO], capsys)
    assert exit_code == code
    line = error_line(stderr)
    assert said in line
    assert f"{out} is written and complete" in line and f"`hf upload {REPO} {out} --private`" in line
    assert tree(out) == reference and not online.commits


def test_a_hub_that_accepts_and_never_answers_ends_the_run_within_seconds(source, reference, tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    with SilentHub() as hub:
        done = quantize(source, out, hub.url, "--upload-repo", REPO, timeout=60)
    port = hub.port
    assert done.returncode == 4, done.stderr
    line = error_line(done.stderr)
    assert f"127.0.0.1:{port} accepted the connection but did not answer within 3 s" in line
    assert f"{out} is written and complete" in line
    assert time.monotonic() - started < 30
    assert tree(out) == reference


def test_a_request_the_hub_stops_answering_is_bounded(source, reference, online, tmp_path, capsys, monkeypatch):
    """The probe passes, then the commit gets no answer: the request's own timeout ends it."""
    from qconvert.write import upload

    monkeypatch.setattr(upload, "ANSWER_TIMEOUT_S", 1.0)
    online.stall.add("commit")
    out = tmp_path / "out"
    started = time.monotonic()
    code, _, stderr = run(["quantize", str(source), "-o", str(out), "--upload-repo", REPO], capsys)
    assert code == 4
    line = error_line(stderr)
    assert f"the Hub did not answer the upload to {REPO} (127.0.0.1:" in line
    assert "accepted the request but sent nothing for 1 s: POST /api/models/someone/tiny-int8/commit/main" in line
    assert time.monotonic() - started < 20
    assert tree(out) == reference


def test_a_signal_stops_the_upload_and_leaves_out_complete(source, reference, hub, tmp_path):
    hub.stall.add("commit")
    hub.arrived["commit"] = threading.Event()
    out = tmp_path / "out"
    proc = subprocess.Popen(command(["quantize", str(source), "-o", str(out), "--upload-repo", REPO]),
                            env=environment(hub.url, TOKEN, tmp_path / "hf-home"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert hub.arrived["commit"].wait(60), "the upload never reached its commit"
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert error_line(stderr) == "qconvert: error: interrupted"
    assert time.monotonic() - stopped < 10
    assert tree(out) == reference and not hub.commits


def test_of_several_processes_only_process_0_checks_a_token_and_uploads(source, reference, hub, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "out"
    procs = [subprocess.Popen(command(["quantize", str(source), "-o", str(out), "--upload-repo", REPO, "--coordinator",
                                       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]),
                              env=environment(hub.url, TOKEN if i == 0 else None, tmp_path / f"hf-home-{i}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    files = sum(digest is not None for digest in reference.values())
    assert f"uploaded {files} files" in results[0][0] and results[1] == ("", "")
    assert [c.repo for c in hub.commits] == [REPO]
    assert len([r for r in hub.requests if hub.kind_of(r.method, r.path) == "create"]) == 1
    assert tree(out) == reference
