"""`qconvert quantize` end to end: the flags and inputs it refuses (one line, its exit code, nothing left behind),
what it copies beside the weights, where it may write and what --overwrite may replace, and its summary."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree

RANDOM = ["--calib", "random"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


@pytest.fixture
def llama(tmp_path):
    return make_llama_checkpoint(tmp_path / "src", dtype="bfloat16")


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


@pytest.mark.parametrize("damp", ["1e-12", "1e-30"])
def test_gptq_on_a_hessian_that_cannot_be_factored_is_refused_not_written_as_nan(llama, tmp_path, capsys, damp):
    """Few tokens and a dampening inside the documented range: the Cholesky of the damped Hessian is NaN in
    float32. It was cast to zero codes and NaN in qconvert.json, exit 0."""
    before = tree(tmp_path)
    code, _, err = run(["quantize", str(llama), "-o", str(tmp_path / "out"), "--scheme", "int4", *RANDOM,
                        "--calib-samples", "1", "--calib-seqlen", "4", "--gptq-damp", damp], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("qconvert: error: GPTQ cannot round model.layers.0.")
    # The window's first token counts for q/k/v only (GPTQ's Hessian leaves it out of the others').
    tokens = 4 if line.split(":")[2].strip().split()[-1].endswith(("q_proj", "k_proj", "v_proj")) else 3
    assert f"--gptq-damp {float(damp):g}, is not positive definite in float32 ({tokens} calibration tokens" in line
    assert "raise --gptq-damp (default 0.1)" in line
    assert tree(tmp_path) == before


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


def test_side_files_are_matched_folder_by_folder_and_never_from_hidden_or_deeper_folders(llama, tmp_path, capsys):
    """fnmatch's `*` crossed `/`: a work folder's git config (with a token), notes and a float copy of the
    weights under tokenizer_work/, and 2_Dense/private/creds.json, were copied into OUT and hashed."""
    from checkpoints import make_tokenizer

    make_tokenizer(llama)
    for rel, text in {"tokenizer_work/.git/config": "[http] token = secret\n",
                      "tokenizer_work/notes.txt": "private notes\n",
                      "tokenizer_work/weights.json": "{}\n",
                      "2_Dense/private/creds.json": '{"key": "secret"}\n',
                      ".cache/tokenizer.json": "{}\n",
                      "2_Dense/config.json": '{"in_features": 64}\n'}.items():
        (llama / rel).parent.mkdir(parents=True, exist_ok=True)
        (llama / rel).write_text(text)
    code, _, err = run(["quantize", str(llama), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert code == 0, err
    written = {p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert {"tokenizer.json", "tokenizer_config.json", "2_Dense/config.json"} <= written
    assert not {w for w in written if w.startswith(("tokenizer_work", ".cache", "2_Dense/private"))}
    import json

    record = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    assert not [f for f in record["source"]["files"] if "private" in f or "tokenizer_work" in f or ".cache" in f]


@pytest.mark.parametrize("change, first, why", [
    (lambda out: (out / "README.md").write_text((out / "README.md").read_text() + "\\nMy notes.\\n"),
     "README.md", "was changed since qconvert wrote it"),
    (lambda out: (out / "drafts").mkdir(), "drafts", "is a folder qconvert did not make"),
    (lambda out: (out / "drafts" / "deeper").mkdir(parents=True), "drafts", "is a folder qconvert did not make"),
])
def test_overwrite_keeps_the_users_edits_and_folders(llama, tmp_path, capsys, change, first, why):
    """--overwrite replaced a model card the user had edited (listed in qconvert.json, another sha256) and deleted
    an empty folder the user made inside OUT."""
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    change(out)
    before = tree(tmp_path)
    code, _, err = run(["quantize", str(llama), "-o", str(out), "-q", "--overwrite"], capsys)
    assert code == 8
    (line,) = err.strip().splitlines()
    assert f"is not a folder qconvert wrote: {first} {why}" in line
    assert tree(tmp_path) == before


def test_overwrite_still_replaces_a_folder_qconvert_wrote_and_verify_updated(llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    assert run(["verify", str(out), "--quick", "--backend", "xla", "--update-card", "-q"], capsys)[0] == 0
    code, _, err = run(["quantize", str(llama), "-o", str(out), "-q", "--overwrite"], capsys)
    assert code == 0, err


def test_places_a_run_will_write_are_proven_writable_before_the_run(llama, tmp_path, capsys):
    """w8a8 into a folder it cannot write calibrated fully, then exit 9; verify --json-file into one printed PASS,
    then exit 9 (the verdict's code lost). /sys refuses new files even to root."""
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    for args, what in ((["quantize", str(llama), "-o", "/sys/qconvert-out", "--scheme", "w8a8"], "the output"),
                       (["calibrate", str(llama), "-o", "/sys/qconvert-stats.safetensors"], "the statistics file"),
                       (["verify", str(out), "--backend", "xla", "--json-file", "/sys/qconvert-report.json"],
                        "--json-file")):
        code, stdout, err = run(args, capsys)
        assert code == 9, (args, err)
        (line,) = err.strip().splitlines()
        assert line.startswith(f"qconvert: error: cannot write {what}") and "Permission denied" in line
        assert "calibrating" not in err and "PASS" not in stdout + err


def test_a_disk_too_small_for_the_output_and_gptqs_scratch_is_refused_before_the_run(llama, tmp_path, capsys,
                                                                                     monkeypatch):
    """A full disk during GPTQ's scratch writes was the bare line "No space left on device", after calibrating."""
    from qconvert.write import folder

    monkeypatch.setattr(folder, "free_bytes", lambda path: 50_000)
    before = tree(tmp_path)
    code, _, err = run(["quantize", str(llama), "-o", str(tmp_path / "out"), "--scheme", "int4", *RANDOM], capsys)
    assert code == 9
    (line,) = err.strip().splitlines()[-1:]
    assert "the output and GPTQ's scratch" in line and "which has 0.00 GiB free" in line
    assert "calibrating" not in err
    assert tree(tmp_path) == before
    monkeypatch.setattr(folder, "free_bytes", lambda path: 10**12)
    assert run(["quantize", str(llama), "-o", str(tmp_path / "out"), "--scheme", "int4", *RANDOM, "-q"],
               capsys)[0] == 0


def test_messages_name_the_real_cause(llama, tmp_path, capsys):
    """Three lines that blamed the wrong thing: a model's max_position_embeddings of 1 was "--calib-seqlen 1
    leaves no room"; --include lm_head on a tied model said "check the pattern"; verify --reference of an
    already-quantized folder blamed its config.json against its weights."""
    import json

    from checkpoints import make_tokenizer

    config = json.loads((llama / "config.json").read_text())
    short = tmp_path / "short"
    make_llama_checkpoint(short)
    make_tokenizer(short)
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1}))
    code, _, err = run(["quantize", str(short), "-o", str(tmp_path / "o1"), "--scheme", "w8a8",
                        "--calib-seqlen", "512"], capsys)
    assert code == 6
    assert err.strip().endswith("config.json's max_position_embeddings 1 caps a window at 1 token(s), which leaves "
                                "no room besides the model's 1 special token(s); fix max_position_embeddings")

    tied = make_llama_checkpoint(tmp_path / "tied", tie=True)
    code, _, err = run(["quantize", str(tied), "-o", str(tmp_path / "o2"), "--include", "lm_head"], capsys)
    assert code == 2
    assert "this model has no lm_head weight of its own" in err and "check the pattern" not in err

    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    # The same input, the same exit code from every command (5: an already quantized checkpoint).
    for args, expected in ((["verify", str(out), "--reference", str(out), "--backend", "xla"], 5),
                           (["quantize", str(out), "-o", str(tmp_path / "o3")], 5),
                           (["calibrate", str(out), "-o", str(tmp_path / "s.safetensors")], 5)):
        code, _, err = run(args, capsys)
        assert code == expected, err
        (line,) = err.strip().splitlines()
        assert f"{out} is already quantized (its config.json has a quantization_config, quant_method " in line


def test_a_live_run_in_another_pid_namespace_keeps_its_temporaries(tmp_path):
    """A run in another container on a shared volume found a live run's pid "dead" (it means nothing in its own
    namespace) and deleted its GPTQ scratch. The marker's lock, held for the run's life, is the proof of life;
    and its record names another PID namespace, so it is never this namespace's to remove."""
    import subprocess
    import sys

    from qconvert.write.temporaries import stale_temporaries

    out = tmp_path / "out"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from qconvert.write.temporaries import make_temporary, TEMPORARY_MARKER\n"
         f"path = make_temporary(Path({str(out)!r}), '.scratch')\n"
         "(path / TEMPORARY_MARKER).write_text('{\"pid\": 999999, \"pid_namespace\": \"pid:[1]\"}')  # another's\n"
         "print(path, flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = Path(child.stdout.readline().strip())
    try:
        assert path.is_dir()
        assert stale_temporaries(out) == []  # pid 999999 runs nowhere here, but the lock is held
    finally:
        child.communicate("", timeout=60)
    assert stale_temporaries(out) == []  # its lock is gone, but nothing proves its maker dead here


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
