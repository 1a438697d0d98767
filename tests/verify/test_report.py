"""verify's report names a reference that is itself quantized (an FP8 folder read as float): a line under the
table, the verdict's last clause, and `reference.quantized` / `reference.format` in the JSON record; a float
reference's report is as it was."""

from __future__ import annotations

import json

import pytest

from cli_helpers import quantize_quietly, run, tree
from fp8_checkpoints import write_fp8_source
from hf_checkpoints import make_hf_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    bf16 = make_hf_checkpoint(root / "bf16", "qwen3", hidden=200, intermediate=160, layers=1, dtype="bfloat16")
    return {"bf16": bf16, "out": quantize_quietly(bf16, root / "out"),
            "fp8": write_fp8_source(bf16, root / "fp8"),
            "compressed": write_fp8_source(bf16, root / "compressed", style="compressed")}, root


@pytest.mark.parametrize("reference, fmt", [("fp8", "fp8-block-128x128"),
                                            ("compressed", "compressed-tensors-fp8-block-128x128")])
def test_a_quantized_reference_is_named_in_the_text_and_the_json(folders, capsys, reference, fmt):
    paths, root = folders
    before = tree(root)
    code, stdout, stderr = run(["verify", str(paths["out"]), "--reference", str(paths[reference]), "--quick"],
                               capsys)
    assert code == 0, stderr
    lines = stdout.splitlines()
    note = (f"reference: {paths[reference]} is itself quantized ({fmt}), read with its fp8 weights dequantized to "
            "bfloat16: the figures compare against those, not against the float model it was made from")
    assert lines.count(note) == 1
    assert lines[-1].startswith(f"PASS int8 {paths['out']}: ")
    assert lines[-1].endswith(f"; against a quantized reference ({fmt})")
    code, stdout, stderr = run(["verify", str(paths["out"]), "--reference", str(paths[reference]), "--quick",
                                "--json"], capsys)
    record = json.loads(stdout)
    assert code == 0 and record["reference"]["quantized"] is True and record["reference"]["format"] == fmt
    assert record["verdict"].endswith(f"; against a quantized reference ({fmt})") and note in stderr.splitlines()
    assert tree(root) == before  # verify writes nothing without --update-card or --json-file


def test_a_float_reference_says_nothing_more(folders, capsys):
    paths, _ = folders
    code, stdout, _ = run(["verify", str(paths["out"]), "--quick", "--json"], capsys)
    record = json.loads(stdout)
    assert code == 0 and record["reference"]["quantized"] is False and record["reference"]["format"] is None
    assert "quantized reference" not in record["verdict"]
    code, stdout, _ = run(["verify", str(paths["out"]), "--reference", str(paths["bf16"]), "--quick"], capsys)
    assert code == 0 and not any(line.startswith("reference:") for line in stdout.splitlines())
    assert "quantized reference" not in stdout
