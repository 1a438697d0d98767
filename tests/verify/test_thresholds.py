"""verify's thresholds follow from hashed content: the activation mode comes from config.json's
quantization_config (covered by qconvert.json's hashes), and qconvert.json's unhashed flags must agree with it."""

import json
import shutil

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run

CALIB = ["--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16"]


@pytest.fixture(scope="module")
def static_out(tmp_path_factory):
    from qconvert.cli.main import main

    root = tmp_path_factory.mktemp("thresholds-source")
    src = make_llama_checkpoint(root / "model")
    out = root / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(src), "-o", str(out), "--scheme", "w8a8", "--act", "static", "-q", *CALIB])
    assert exit_info.value.code == 0
    return out


def test_the_thresholds_are_those_of_the_activation_mode_config_json_describes(static_out, capsys):
    exit_code, stdout, _ = run(["verify", str(static_out), "--quick", "--json", "-"], capsys)
    report = json.loads(stdout)
    assert report["thresholds"]["min_layer_sqnr_db"] == 15.0  # w8a8 --act static's row, not dynamic's 20


def test_an_edited_act_flag_in_qconvert_json_fails_integrity_instead_of_moving_thresholds(static_out, tmp_path,
                                                                                          capsys):
    folder = tmp_path / "edited"
    shutil.copytree(static_out, folder)
    record = json.loads((folder / "qconvert.json").read_text())
    record["flags"]["act"] = "dynamic"
    (folder / "qconvert.json").write_text(json.dumps(record, indent=2))
    exit_code, stdout, _ = run(["verify", str(folder), "--quick", "--json", "-"], capsys)
    report = json.loads(stdout)
    assert exit_code == 1
    assert report["integrity"]["problems"] == [
        "qconvert.json: flags.act is 'dynamic', but config.json's quantization_config describes static activations"]
