"""Inputs of the fourth reliability round: each fails with one line and its exit code where it used to write a
silently wrong folder, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree

RANDOM = ["--calib", "random"]


@pytest.fixture
def llama(tmp_path):
    return make_llama_checkpoint(tmp_path / "src", dtype="bfloat16")


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


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_where_the_ids_are_made(tmp_path, capsys):
    """The embedding's gather filled NaN for such ids: w8a8 chose alpha 0 everywhere and GPTQ fell back to
    rounding, exit 0. Refused for every command that tokenizes (quantize's calibration, calibrate, verify's
    evaluation text all read it through one function)."""
    from checkpoints import make_tokenizer

    folder = make_llama_checkpoint(tmp_path / "src", vocab=64)
    make_tokenizer(folder, vocab_size=512)
    before = tree(tmp_path)
    for args in (["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8"],
                 ["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "int4"],
                 ["calibrate", str(folder), "-o", str(tmp_path / "stats.safetensors")]):
        code, _, err = run(args, capsys)
        assert code == 6, (args, err)
        (line,) = err.strip().splitlines()[-1:]
        assert "tokenizer.json gives token id " in line and "outside config.json's vocab_size 64" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("text, messages", [
    ("hello", ["gives 1 token(s) of text; calibrating needs at least 16"]),
    ("\ufeff" + "\x00" * 200, ["token(s) of text; calibrating needs at least 16", "holds no word"]),
    ("... ; , !! ?? " * 40, ["holds no word"]),
])
def test_calibration_text_that_fits_nothing_is_refused(tmp_path, capsys, text, messages):
    """One token (or only a BOM and NULs) was accepted: --act static fitted every scale on two tokens, exit 0."""
    from checkpoints import make_tokenizer

    folder = make_llama_checkpoint(tmp_path / "src")
    make_tokenizer(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text(text, encoding="utf-8")
    before = tree(tmp_path)
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8", "--act", "static",
                        "--calib", str(calib)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()[-1:]
    assert any(message in line for message in messages), line
    assert tree(tmp_path) == before


def _corpus(name: str) -> str:
    from importlib import resources

    return resources.files("qconvert").joinpath("data", name).read_text(encoding="utf-8")


@pytest.mark.parametrize("vocab", [16, 24, 64, 128, 512, "minilm"])
def test_the_built_in_corpora_share_no_run_under_every_tokenizer_the_tests_use(tmp_path, vocab):
    """verify's held-out text against the built-in calibration text, each tokenized whole: no run of 16 tokens in
    common, once the runs of unknown words (any words, to a small vocabulary) are set aside."""
    import numpy as np
    from tokenizers import Tokenizer

    from checkpoints import make_tokenizer, minilm_path
    from qconvert.verify.held_out import NGRAM, shared_ngrams, unknown_id

    folder = minilm_path() if vocab == "minilm" else make_tokenizer(tmp_path, vocab_size=vocab)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    calibration, evaluation = (np.asarray([tokenizer.encode(_corpus(name), add_special_tokens=False).ids])
                               for name in ("calibration.txt", "evaluation.txt"))
    assert shared_ngrams(evaluation, calibration, NGRAM, unknown_id(folder)) == 0


def test_verify_after_a_default_conversion_under_a_small_vocabulary_is_not_refused(tmp_path, capsys):
    """Runs of unknown words matched across the corpora, and verify refused its own default evaluation text."""
    from checkpoints import make_tokenizer

    folder = make_llama_checkpoint(tmp_path / "src")
    make_tokenizer(folder, vocab_size=16)
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "int8", "--gptq", "-q"],
                       capsys)
    assert code == 0, err
    code, out, err = run(["verify", str(tmp_path / "out"), "--quick", "--backend", "xla"], capsys)
    assert "shares" not in err and code in (0, 1), err
    assert "held out from calibration" in out + err


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_calibrating_on_verifys_held_out_text_is_refused(llama, tmp_path, capsys, command):
    """quantize --calib held-out calibrated on verify's evaluation text and recorded it as never calibrated on."""
    out = tmp_path / ("out" if command == "quantize" else "stats.safetensors")
    args = ["--scheme", "w8a8"] if command == "quantize" else []
    before = tree(tmp_path)
    code, _, err = run([command, str(llama), "-o", str(out), *args, "--calib", "held-out"], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("qconvert: error: --calib held-out is verify's evaluation text")
    assert tree(tmp_path) == before


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


def test_verify_json_file_writes_only_where_qconvert_may(llama, tmp_path, capsys):
    """--json-file replaced any file: OUT's weights it had just verified, or the source's float weights."""
    import json

    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    before = tree(tmp_path)
    verify = ["verify", str(out), "--quick", "--backend", "xla", "--json-file"]
    for target, code, message in ((out / "model.safetensors", 2, "lies inside the folder verified"),
                                  (out / "report.json", 2, "lies inside the folder verified"),
                                  (llama / "model.safetensors", 8, "is not a verify record qconvert wrote"),
                                  (notes, 8, "is not a verify record qconvert wrote")):
        got, _, err = run([*verify, str(target)], capsys)
        assert got == code, err
        (line,) = err.strip().splitlines()
        assert message in line
    assert tree(tmp_path) == before
    report = tmp_path / "report.json"
    for _ in range(2):  # its own record it replaces, beside and renamed
        got, _, err = run([*verify, str(report)], capsys)
        assert got == 0, err
        assert json.loads(report.read_text())["passed"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out", "report.json", "src"]


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


def test_the_card_names_loosened_thresholds_and_quick(llama, tmp_path, capsys):
    """verify --update-card wrote PASS into the card under loosened thresholds (and --quick) without naming them."""
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    code, _, err = run(["verify", str(out), "--quick", "--backend", "xla", "--update-card", "-q",
                        "--max-kl", "5", "--min-sqnr", "1"], capsys)
    assert code == 0, err
    card = (out / "README.md").read_text()
    assert "- under thresholds given on the command line, not the scheme's: max_mean_kl 5, min_layer_sqnr_db 1" in card
    assert "- with `--quick`: a small evaluation sample, a smoke check" in card
    code, _, err = run(["verify", str(out), "--backend", "xla", "--update-card", "-q"], capsys)
    assert code == 0, err
    card = (out / "README.md").read_text()  # the defaults, in full: neither line
    assert "thresholds given on the command line" not in card and "--quick" not in card


def test_inspect_names_per_channel_int4_apart_from_group_128(llama, tmp_path, capsys):
    """inspect printed group-128's server verdicts (yes for vLLM GPU) for a per-channel int4 folder, never
    measured."""
    import json

    from qconvert.formats.layout_base import LayoutFlags
    from qconvert.schemes.servers import scheme_key

    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "--scheme", "int4", "--group-size", "channel", "--no-gptq", "--no-awq",
                "-q"], capsys)[0] == 0
    code, text, _ = run(["inspect", str(out), "--json"], capsys)
    assert code == 0
    assert set(json.loads(text)["servers"].values()) == {"not measured"}
    assert scheme_key("int4", LayoutFlags(group_size=None)) == "int4-channel"
    assert scheme_key("int4", LayoutFlags(group_size=128)) == "int4"
    assert scheme_key("int4", LayoutFlags(group_size=64)) == "int4-g64"
    assert scheme_key("int8", LayoutFlags()) == "int8"


def test_a_calibration_that_cannot_fit_this_machine_is_refused_before_any_window(llama, tmp_path, capsys):
    """--calib-samples 1e9 (and verify --samples 1e9) were exit 70 (MemoryError making the windows), 20000 on a
    tiny model std::bad_alloc or the OOM killer: refused, exit 2, naming the estimate, before any work."""
    huge = "1000000000"
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    before = tree(tmp_path)
    for args, flag in ((["quantize", str(llama), "-o", str(tmp_path / "o2"), "--scheme", "int4", "--calib-samples",
                         huge], "--calib-samples"),
                       (["quantize", str(llama), "-o", str(tmp_path / "o2"), "--scheme", "w8a8", "--calib", "random",
                         "--calib-samples", huge], "--calib-samples"),
                       (["calibrate", str(llama), "-o", str(tmp_path / "s.safetensors"), "--calib-samples", huge],
                        "--calib-samples"),
                       (["verify", str(out), "--backend", "xla", "--samples", huge], "--samples")):
        code, _, err = run(args, capsys)
        assert code == 2, (args, err)
        (line,) = err.strip().splitlines()[-1:]
        assert f"on 1,000,000,000 x " in line and "GiB of this machine's memory even one window at a time" in line
        assert f"fewer {flag}" in line
    assert tree(tmp_path) == before


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


def _tampered(out, edit):
    """Edit config.json's quantization_config and record the edited file's sha256, as a careful tamperer would."""
    import hashlib
    import json

    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    record = json.loads((out / "qconvert.json").read_text())
    record["files"]["config.json"] = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    (out / "qconvert.json").write_text(json.dumps(record, indent=2))


@pytest.mark.parametrize("edit, path", [
    (lambda q: q.update(quantization_status="frozen"), "quantization_config.quantization_status"),
    (lambda q: q["config_groups"]["group_0"].update(format="int-quantized"), "quantization_config.config_groups.group_0.format"),
    (lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8, "type": "int"}),
     "quantization_config.config_groups.group_0.output_activations"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(observer="mse"),
     "quantization_config.config_groups.group_0.weights.observer"),
])
def test_verify_compares_the_quantization_config_key_for_key(llama, tmp_path, capsys, edit, path):
    """quantization_config edits with the hashes redone passed verify: "frozen" makes transformers run
    uninitialised float weights (KL 0.59)."""
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    _tampered(out, edit)
    code, text, err = run(["verify", str(out), "--quick", "--backend", "xla"], capsys)
    assert code == 1, err
    assert f"config.json: {path} is " in text + err and "but qconvert writes" in text + err


def test_a_live_run_in_another_pid_namespace_keeps_its_temporaries(tmp_path):
    """A run in another container on a shared volume found a live run's pid "dead" (it means nothing in its own
    namespace) and deleted its GPTQ scratch. The marker's lock, held for the run's life, is the proof of life."""
    import subprocess
    import sys

    from qconvert.write.temporaries import stale_temporaries

    out = tmp_path / "out"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from qconvert.write.temporaries import make_temporary, TEMPORARY_MARKER\n"
         f"path = make_temporary(Path({str(out)!r}), '.scratch')\n"
         "(path / TEMPORARY_MARKER).write_text('999999\\n')  # its pid as another namespace numbers it\n"
         "print(path, flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = Path(child.stdout.readline().strip())
    try:
        assert path.is_dir()
        assert stale_temporaries(out) == []  # pid 999999 runs nowhere here, but the lock is held
    finally:
        child.communicate("", timeout=60)
    assert [p.name for p in stale_temporaries(out)] == [path.name]  # its run has ended: stale now


@pytest.mark.parametrize("scheme", ["w8a8", "int4"])
def test_nan_activations_stop_calibration_where_they_appear(tmp_path, capsys, scheme):
    """A NaN weight inside a layer made every statistic after it NaN: w8a8 chose alpha 0 everywhere and GPTQ fell
    back to rounding, before the writer's own NaN check. The statistics are checked where they are made."""
    from safetensors.numpy import load_file, save_file

    folder = make_llama_checkpoint(tmp_path / "src")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / "model.safetensors")
    before = tree(tmp_path)
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", scheme, *RANDOM], capsys)
    assert code == 7, err
    (line,) = err.strip().splitlines()[-1:]
    assert line == ("qconvert: error: calibration: the input of model.layers.0.mlp.down_proj holds NaN or Inf: the "
                    "float model overflows there, or a weight before it is not finite; fix the checkpoint")
    assert tree(tmp_path) == before
