"""int4-asym folders of Llama, Qwen3, Gemma 3, Mixtral and Qwen3-MoE (tiny, built by transformers) convert by
round-to-nearest and by GPTQ (the default), pass `qconvert verify` through the Pallas int4 kernels with zero
points, and load in transformers + compressed-tensors as meant: its logits equal those of the float model holding
qconvert's own dequantization ((q - z) * s), and stay close to the float model's (dense families; MoE ones:
compressed-tensors' own decompression of every linear equals qconvert's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

MOE = ("mixtral", "qwen3_moe")
# (family, rounding): each family once, plain rounding and GPTQ (on a few random windows) each on a dense and an MoE
# family.
CASES = [("llama", "gptq"), ("qwen3", "rtn"), ("gemma3", "rtn"), ("mixtral", "rtn"), ("qwen3_moe", "gptq")]


@pytest.mark.parametrize("family, rounding", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_converts_passes_verify_and_loads_in_transformers(family, rounding, tmp_path, capsys):
    source, out = family_source(tmp_path, family), tmp_path / "int4-asym"
    flags = (["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"] if rounding == "gptq"
             else ["--no-gptq", "--no-awq"])
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "W4A16_ASYM", "-q", *flags], capsys)
    assert code == 0, err
    record = json.loads((out / "qconvert.json").read_text())
    assert record["scheme"] == "int4-asym" and record.get("rounding", {}).get("method", "rtn") == rounding

    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    verified = json.loads(report)
    assert verified["scheme"] == "int4-asym" and verified["passed"]
    assert all(layer["kernel"]["pallas"] for layer in verified["layers"])
    assert min(layer["fidelity_sqnr_db"] for layer in verified["layers"]) >= 40

    card = (out / "README.md").read_text()  # the model card's load: decompressed at load (the layout's note)
    assert "from_pretrained(\"path/to/this/folder\", quantization_config=CompressedTensorsConfig(dequantize=True))" \
        in card and "import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig" in card
    if family in MOE:
        # transformers 5.24 decompresses fused experts without their zero points (its CompressedTensorsDequantize
        # builds each expert from weight_packed, weight_scale and weight_shape only), so the MoE folders are
        # judged by compressed-tensors' own decompression of every quantized linear instead.
        assert_compressed_tensors_decompresses_as_qconvert_means(out)
        return
    ids, mask = token_batch(load_config(source)["vocab_size"])
    loaded = reference_logits(out, ids, mask, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    meant = reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask)
    float_logits = reference_logits(source, ids, mask)
    valid = mask.astype(bool)
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * np.abs(meant[valid]).max()
    a, b = loaded[valid].ravel().astype(np.float64), float_logits[valid].ravel().astype(np.float64)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.95


def assert_compressed_tensors_decompresses_as_qconvert_means(out):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from qconvert.formats.layouts import open_quantized

    qconfig = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = qconfig.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qconfig.format)
    tensors = load_file(str(out / "model.safetensors"))
    folder = open_quantized(out)
    assert any(".experts." in m for m in folder.quantized_modules)
    for module in folder.quantized_modules:
        parts = {suffix: tensors[f"{module}.{suffix}"] for suffix in
                 ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")}
        theirs = compressor.decompress(parts, scheme)["weight"].float().numpy()
        ours = np.asarray(folder.qarray(module).dequantize(parts["weight_scale"].numpy().dtype)).astype(np.float32)
        np.testing.assert_array_equal(ours, theirs, err_msg=module)
    folder.close()
