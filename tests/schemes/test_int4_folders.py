"""int4 folders of Llama, Qwen3, Phi-3, Gemma 3, Mixtral and Qwen3-MoE (tiny, built by transformers) convert,
pass `qconvert verify` through the Pallas int4 kernels, and load in transformers + compressed-tensors as meant:
its logits equal those of the float model holding qconvert's own dequantized weights, and stay close to the
float model's. The folders are rounded by GPTQ (int4's default), experts each on their own Hessian."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FAMILIES = ("llama", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return family_source(root, request.param), root / "int4"


def convert(source, out, capsys):
    # GPTQ (int4's default) on a few random windows: the folders are GPTQ's, the layout the same.
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "int4", "--calib", "random",
                            "--calib-samples", "4", "--calib-seqlen", "32", "-q"], capsys)
    assert code == 0, err
    assert json.loads((out / "qconvert.json").read_text())["rounding"]["method"] == "gptq"


def test_converts_and_passes_verify_through_the_pallas_kernels(converted, capsys):
    source, out = converted
    convert(source, out, capsys)
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    record = json.loads(report)
    assert record["scheme"] == "int4" and record["passed"]
    assert record["rounding"]["method"] == "gptq"  # named from qconvert.json; the thresholds are int4's
    assert all(layer["kernel"]["pallas"] for layer in record["layers"])
    assert min(layer["fidelity_sqnr_db"] for layer in record["layers"]) >= 40


def test_loads_in_transformers_and_compressed_tensors_as_qconvert_means_it(converted, capsys, tmp_path):
    source, out = converted
    if not out.exists():
        convert(source, out, capsys)
    config = load_config(source)
    ids, mask = token_batch(config["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # transformers + compressed-tensors reading the int4 folder
    meant = reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask)
    float_logits = reference_logits(source, ids, mask)
    valid = mask.astype(bool)
    scale = np.abs(meant[valid]).max()
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * scale
    a, b = loaded[valid].ravel().astype(np.float64), float_logits[valid].ravel().astype(np.float64)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.95
