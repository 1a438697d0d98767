"""`quantize` resolves MODEL once and opens each shard once, even while a Hub branch moves to another commit."""

import hashlib
import json
from collections import Counter

import pytest
from safetensors.numpy import load_file, save_file

from checkpoints import make_llama_checkpoint
from cli_helpers import run
from hub_cache import build_hub_cache

FIRST = "1111111111111111111111111111111111111111"
SECOND = "2222222222222222222222222222222222222222"
REPO = "org/moving-llama"
W8A8 = ["--scheme", "w8a8", "--act", "static", "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16"]


@pytest.fixture
def moving_branch(tmp_path, monkeypatch):
    """A Hub cache whose `main` is FIRST until the first resolution ends, then SECOND (other weights).

    Returns the folder of the FIRST commit's files and a Counter of the
    resolutions (snapshot downloads) made.
    """
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = make_llama_checkpoint(tmp_path / "first", shards=2)
    second = make_llama_checkpoint(tmp_path / "second", shards=2)
    for shard in sorted(second.glob("*.safetensors")):  # the same shapes, other values
        save_file({k: v * 2 for k, v in load_file(str(shard)).items()}, str(shard))
    build_hub_cache(home, REPO, second, commit=SECOND)
    build_hub_cache(home, REPO, first, commit=FIRST)  # refs/main -> FIRST
    ref = home / "hub" / ("models--" + REPO.replace("/", "--")) / "refs" / "main"
    assert ref.read_text() == FIRST

    import huggingface_hub

    resolutions = Counter()
    real_snapshot_download = huggingface_hub.snapshot_download

    def snapshot_download(*args, **kwargs):
        folder = real_snapshot_download(*args, **kwargs)
        resolutions[kwargs.get("revision")] += 1
        ref.write_text(SECOND)  # the branch moves on: a second resolution would land on SECOND
        return folder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return first, resolutions


@pytest.fixture
def shard_opens(monkeypatch):
    """Counters of header reads and data-handle opens, per safetensors file path."""
    from qconvert.formats import safetensors_io

    headers, handles = Counter(), Counter()
    real_read_header, real_safe_open = safetensors_io.read_header, safetensors_io.safe_open

    def read_header(path, *args, **kwargs):
        headers[str(path)] += 1
        return real_read_header(path, *args, **kwargs)

    def safe_open(path, *args, **kwargs):
        handles[str(path)] += 1
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(safetensors_io, "read_header", read_header)
    monkeypatch.setattr(safetensors_io, "safe_open", safe_open)
    return headers, handles


@pytest.mark.parametrize("flags", [["--scheme", "int8"], W8A8], ids=["int8", "w8a8-static"])
def test_quantize_resolves_once_and_reads_one_commit(moving_branch, shard_opens, tmp_path, capsys, flags):
    first, resolutions = moving_branch
    headers, handles = shard_opens
    out = tmp_path / "out"
    code, _, stderr = run(["quantize", REPO, "-o", str(out), "-q", *flags], capsys)
    assert code == 0, stderr
    assert resolutions == Counter({FIRST: 1})
    record = json.loads((out / "qconvert.json").read_text())
    assert record["source"]["commit"] == FIRST
    # every shard calibration and conversion read is FIRST's, each opened once
    shards = sorted(p.name for p in first.glob("*.safetensors"))
    assert len(shards) == 2
    for counter in (headers, handles):
        assert all(f"/snapshots/{FIRST}/" in path for path in counter), counter
        assert sorted(path.rsplit("/", 1)[1] for path in counter) == shards, counter
        assert set(counter.values()) == {1}, counter
    # the recorded source hashes are FIRST's files, hashed here
    for name in shards:
        assert record["source"]["files"][name] == hashlib.sha256((first / name).read_bytes()).hexdigest()
    if "w8a8" in flags:  # calibrated and smoothed: a static input_scale for each of the 2 x 7 linears
        assert record["calibration"] is not None and record["smoothing"] is not None
        written = {k: v for s in out.glob("*.safetensors") for k, v in load_file(str(s)).items()}
        scales = [v for k, v in written.items() if k.endswith(".input_scale")]
        assert len(scales) == 14 and all(float(v[0]) > 0 for v in scales)


def test_calibrate_resolves_once_and_opens_each_shard_once(moving_branch, shard_opens, tmp_path, capsys):
    first, resolutions = moving_branch
    headers, handles = shard_opens
    stats = tmp_path / "stats.safetensors"
    code, _, stderr = run(["calibrate", REPO, "-o", str(stats), "--calib", "random", "--calib-samples", "2",
                           "--calib-seqlen", "16"], capsys)
    assert code == 0, stderr
    assert resolutions == Counter({FIRST: 1})
    shards = sorted(p.name for p in first.glob("*.safetensors"))
    opened = [path for path in headers if path != str(stats)]
    assert all(f"/snapshots/{FIRST}/" in path for path in opened), headers
    assert sorted(path.rsplit("/", 1)[1] for path in opened) == shards
    assert all(headers[path] == 1 for path in opened), headers
