"""fp8 folders of Llama, Qwen3, Gemma 3, Mixtral and Qwen3-MoE (tiny, built by transformers) convert,
pass `qconvert verify` through the Pallas fp8 kernels, and load in transformers + compressed-tensors as meant:
its logits equal those of the float model holding qconvert's own dequantized weights, and stay close to the
float model's.

transformers + compressed-tensors quantizes each quantized linear's input to fp8 per token in its forward
(the folder's input_activations: dynamic, per token), so "as meant" is the float model holding the
dequantized weights with that same per-token E4M3 rounding of every quantized linear's input, applied
here by a hook written from the format's definition: scale = absmax / 448 per token, x / scale cast to
float8_e4m3fn (round to nearest even, saturated), times the scale."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch
from peer_references import meant_logits
from qconvert.formats.layouts import open_quantized

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FAMILIES = ("llama", "qwen3", "gemma3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return family_source(root, request.param), root / "fp8"


def convert(source, out, capsys):
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "fp8", "-q"], capsys)
    assert code == 0, err


def test_converts_and_passes_verify_through_the_pallas_kernels(converted, capsys):
    source, out = converted
    convert(source, out, capsys)
    # These are tiny random-weight models: their perplexity on verify's held-out English text is noise around
    # the 1.1 ceiling, and says nothing of fp8 (docs/ACCURACY.md measures that on trained models). What this
    # test holds is the kernel path and its fidelity, so the quality ceiling is widened here only.
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-",
                                 "--max-ppl-ratio", "1.25"], capsys)
    assert code == 0, err
    record = json.loads(report)
    assert record["scheme"] == "fp8" and record["passed"]
    assert all(layer["kernel"]["pallas"] for layer in record["layers"])
    assert min(layer["fidelity_sqnr_db"] for layer in record["layers"]) >= 60


def test_loads_in_transformers_and_compressed_tensors_as_qconvert_means_it(converted, capsys, tmp_path):
    source, out = converted
    if not out.exists():
        convert(source, out, capsys)
    config = load_config(source)
    ids, mask = token_batch(config["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # transformers + compressed-tensors reading the fp8 folder
    modules = open_quantized(out).quantized_modules
    meant, hooked = meant_logits(dequantized_float_folder(source, out, tmp_path / "meant"), modules, ids, mask)
    assert hooked >= 4  # at least the attention linears
    float_logits = reference_logits(source, ids, mask)
    valid = mask.astype(bool)
    scale = np.abs(meant[valid]).max()
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * scale
    a, b = loaded[valid].ravel().astype(np.float64), float_logits[valid].ravel().astype(np.float64)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.95


def test_the_servers_table_holds_for_transformers(converted, capsys):
    # The transformers cells are what the test above checks; the vLLM and vLLM TPU cells are recorded runs
    # of their own loading code (docs/BENCHMARKS.md, "Server acceptance"), which these tests cannot run.
    source, out = converted
    if not out.exists():
        convert(source, out, capsys)
    code, report, err = run_cli(["inspect", str(out), "--json"], capsys)
    assert code == 0, err
    assert json.loads(report)["servers"]["transformers"] == "yes"
