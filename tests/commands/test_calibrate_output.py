"""`calibrate -o` follows quantize's OUT rules, writes atomically, and a statistics file is checked when read."""


import numpy as np
import pytest
from safetensors.numpy import save_file

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint
from qconvert.formats.act_stats import ActStats
from qconvert.calibrate import save_act_stats

CALIB = ["--calib", "random", "--calib-samples", "2", "--calib-seqlen", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("calib-out") / "model")


@pytest.fixture
def fresh_stats(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "stats.safetensors"
    save_act_stats(path, ActStats({"x.q": np.ones(4, np.float32)}, tokens=8))
    return path


@pytest.fixture
def calibration_must_not_run(monkeypatch):
    import qconvert.calibrate

    def refused(*args, **kwargs):
        raise AssertionError("calibrated before OUT was checked")

    monkeypatch.setattr(qconvert.calibrate, "collect_act_stats", refused)


@pytest.mark.parametrize("target,words", [
    ("model.safetensors", "lies inside the input model's folder"),
    ("config.json", "lies inside the input model's folder"),
    ("", "is the input model's folder"),
], ids=["weights", "config", "folder"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_calibrate_refuses_the_input_and_anything_inside_it_with_exit_2(model, target, words, overwrite, capsys,
                                                                        calibration_must_not_run):
    before = tree(model)
    out = model / target if target else model
    exit_code, _, stderr = run(["calibrate", str(model), "-o", str(out), *CALIB]
                               + (["--overwrite"] if overwrite else []), capsys)
    assert exit_code == 2 and len(stderr.splitlines()) == 1 and words in stderr, stderr
    assert tree(model) == before


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_calibrate_never_replaces_a_file_it_did_not_write(model, tmp_path, overwrite, capsys,
                                                          calibration_must_not_run):
    theirs = tmp_path / "weights.safetensors"
    theirs.write_bytes(b"the user's own bytes")
    before = tree(tmp_path)
    exit_code, _, stderr = run(["calibrate", str(model), "-o", str(theirs), *CALIB]
                               + (["--overwrite"] if overwrite else []), capsys)
    expected = (f"qconvert: error: {theirs} is not a statistics file qconvert wrote; --overwrite replaces only "
                "those: choose another -o\n") if overwrite else (
        f"qconvert: error: {theirs} already exists; pass --overwrite to replace it, or choose another -o\n")
    assert (exit_code, stderr) == (8, expected)
    assert tree(tmp_path) == before


def test_calibrate_replaces_its_own_stats_file_only_with_overwrite(model, fresh_stats, capsys):
    before = tree(fresh_stats.parent)
    exit_code, _, stderr = run(["calibrate", str(model), "-o", str(fresh_stats), *CALIB], capsys)
    assert exit_code == 8 and "pass --overwrite" in stderr
    assert tree(fresh_stats.parent) == before
    exit_code, _, _ = run(["calibrate", str(model), "-o", str(fresh_stats), *CALIB, "--overwrite"], capsys)
    assert exit_code == 0
    after = tree(fresh_stats.parent)
    assert list(after) == ["stats.safetensors"] and after != before


def test_a_failed_stats_write_leaves_the_old_file_and_no_temporary(model, fresh_stats, capsys, monkeypatch):
    import qconvert.write.folder

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(qconvert.write.folder.os, "fsync", full_disk)
    before = tree(fresh_stats.parent)
    exit_code, _, stderr = run(["calibrate", str(model), "-o", str(fresh_stats), *CALIB, "--overwrite"], capsys)
    assert (exit_code, stderr.splitlines()[-1] + "\n") == (9, f"qconvert: error: writing {fresh_stats} failed: No space left on device; "
                                      f"{fresh_stats} was left as it was, free space or fix permissions and "
                                      "run again\n")
    assert tree(fresh_stats.parent) == before


def _bad_stats(path, absmax, metadata=None):
    meta = {"format": "qconvert-act-stats", "version": "1", "model": "", "tokens": "8", "calibration": "null"}
    save_file({f"{m}.act_absmax": v for m, v in absmax.items()}, str(path), metadata={**meta, **(metadata or {})})
    return path


@pytest.mark.parametrize("absmax,metadata,what", [
    ({"model.layers.0.self_attn.q_proj": -np.ones(64, np.float32)}, None,
     "model.layers.0.self_attn.q_proj.act_absmax is not a vector of finite maxima >= 0"),
    ({"model.layers.0.self_attn.q_proj": np.full(64, np.nan, np.float32)}, None,
     "model.layers.0.self_attn.q_proj.act_absmax is not a vector of finite maxima >= 0"),
    ({"a": np.ones(4, np.float32)}, {"tokens": "many"}, "metadata 'tokens' is 'many', not a count"),
    ({"a": np.ones(4, np.float32)}, {"calibration": "{not json"}, "metadata 'calibration' is not a JSON object"),
    ({"a": np.ones(4, np.float32)}, {"calibration": "[1]"}, "metadata 'calibration' is not a JSON object"),
], ids=["negative", "nan", "tokens", "calibration-json", "calibration-list"])
def test_a_stats_file_with_bad_maxima_or_metadata_is_refused_with_exit_2(model, tmp_path, capsys, absmax,
                                                                         metadata, what):
    stats = _bad_stats(tmp_path / "bad.safetensors", absmax, metadata)
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(model), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                                "--act-stats", str(stats), "-q"], capsys)
    assert (exit_code, stderr) == (2, f"qconvert: error: activation statistics {stats}: {what}; write it again "
                                      "with `qconvert calibrate`\n")
    assert tree(tmp_path) == before


def test_calibrate_closes_the_checkpoint_it_opened(model, tmp_path, capsys, monkeypatch):
    from qconvert.formats.safetensors_io import SafetensorsCheckpoint

    opened, closed = [], []
    real_init, real_close = SafetensorsCheckpoint.__init__, SafetensorsCheckpoint.close

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        opened.append(self)

    def close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(SafetensorsCheckpoint, "__init__", init)
    monkeypatch.setattr(SafetensorsCheckpoint, "close", close)
    assert run(["calibrate", str(model), "-o", str(tmp_path / "stats.safetensors"), *CALIB], capsys)[0] == 0
    assert opened and all(any(c is o for c in closed) for o in opened)
