"""verify runs the reference's forward and refuses a folder whose config.json was edited after conversion:
every field but quantization_config must equal the source's, even with qconvert.json's hash made to match."""

import hashlib
import json
import shutil

import pytest

from cli_helpers import run
from checkpoints import make_llama_checkpoint


@pytest.fixture(scope="module")
def llama_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("config-edits")
    src = make_llama_checkpoint(root / "model")
    out = root / "out"
    with pytest.raises(SystemExit) as exit_info:
        from qconvert.cli.main import main

        main(["quantize", str(src), "-o", str(out), "-q"])
    assert exit_info.value.code == 0
    return out


@pytest.fixture(scope="module")
def gemma_out(tmp_path_factory):
    from gemma_checkpoints import GEMMA2, make_gemma_checkpoint

    root = tmp_path_factory.mktemp("gemma-config-edits")
    src = make_gemma_checkpoint(root / "model", GEMMA2)
    out = root / "out"
    with pytest.raises(SystemExit) as exit_info:
        from qconvert.cli.main import main

        main(["quantize", str(src), "-o", str(out), "-q"])
    assert exit_info.value.code == 0
    return out


def edited_copy(out, root, edit):
    """A copy of `out` whose config.json has `edit` applied and whose qconvert.json holds the new hash; beside
    `out`, so that qconvert.json finds the source from it as from `out`."""
    folder = out.parent / f"edited-{root.name}"
    shutil.copytree(out, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    record = json.loads((folder / "qconvert.json").read_text())
    record["files"]["config.json"] = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
    (folder / "qconvert.json").write_text(json.dumps(record, indent=2))
    return folder


def verify_problems(folder, capsys):
    exit_code, stdout, _ = run(["verify", str(folder), "--quick", "--json", "-"], capsys)
    return exit_code, json.loads(stdout)["integrity"]["problems"]


def _set(key, value):
    return lambda config: config.__setitem__(key, value)


def _message(path, ours, theirs):
    return (f"config.json: {path} is {ours}, but the reference's config.json has {theirs}; the folder would not "
            "run the model it was converted from")


@pytest.mark.parametrize("edit,path,ours,theirs", [
    (_set("rope_theta", 500000.0), "rope_theta", "500000.0", "10000.0"),
    (_set("rope_scaling", {"rope_type": "linear", "factor": 4.0}), "rope_scaling",
     "{'rope_type': 'linear', 'factor': 4.0}", "absent"),
    (_set("hidden_act", "gelu"), "hidden_act", "'gelu'", "'silu'"),
    (_set("rms_norm_eps", 1e-2), "rms_norm_eps", "0.01", "1e-06"),
    (_set("sliding_window", 4), "sliding_window", "4", "absent"),
    (lambda config: config.pop("rope_theta"), "rope_theta", "absent", "10000.0"),
], ids=["rope_theta", "rope_scaling", "hidden_act", "rms_norm_eps", "sliding_window", "rope_theta-removed"])
def test_verify_fails_a_llama_folder_whose_config_was_edited_naming_the_field(llama_out, tmp_path, capsys, edit,
                                                                              path, ours, theirs):
    reference = json.loads((llama_out / "config.json").read_text())
    if path in reference and theirs != "absent":
        assert repr(reference[path]) == theirs  # the test's premise: the source's own value
    folder = edited_copy(llama_out, tmp_path, edit)
    assert verify_problems(folder, capsys) == (1, [_message(path, ours, theirs)])


@pytest.mark.parametrize("key,value", [("sliding_window", 8), ("query_pre_attn_scalar", 32),
                                       ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                                       ("rms_norm_eps", 1e-3), ("hidden_activation", "gelu")])
def test_verify_fails_a_gemma_folder_whose_config_was_edited_naming_the_field(gemma_out, tmp_path, capsys, key,
                                                                              value):
    reference = json.loads((gemma_out / "config.json").read_text())
    folder = edited_copy(gemma_out, tmp_path, _set(key, value))
    assert verify_problems(folder, capsys) == (1, [_message(key, repr(value), repr(reference.get(key)))])


def test_a_nested_field_is_named_with_its_path_and_only_quantization_config_may_differ():
    from qconvert.verify.integrity import check_config_matches_reference

    source = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_theta": 500000, "tie": True}
    assert check_config_matches_reference({**source, "quantization_config": {"quant_method": "x"}}, source) == []
    assert check_config_matches_reference({**source, "rope_theta": 500000.0}, source) == []  # one JSON number
    assert check_config_matches_reference(
        {**source, "rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, source) == [
        _message("rope_scaling.factor", "4.0", "8.0")]
    assert check_config_matches_reference({**source, "tie": 1}, source) == [_message("tie", "1", "True")]


def test_the_unedited_folder_passes(llama_out, capsys):
    assert verify_problems(llama_out, capsys) == (0, [])
