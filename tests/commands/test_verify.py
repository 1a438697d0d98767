"""`qconvert verify` end to end: what it checks before running, a stray shard and an edited quantization_config it
reports, its held-out text under every tokenizer, where --json-file may write, and what --update-card says."""

from __future__ import annotations

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly, run, tree


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return quantize_quietly(source, tmp_path_factory.mktemp("small-out") / "out")


@pytest.fixture
def llama(tmp_path):
    return make_llama_checkpoint(tmp_path / "src", dtype="bfloat16")


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
