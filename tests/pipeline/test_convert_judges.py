"""The peer libraries judge the layouts: compressed-tensors decompresses the int8 folder, transformers + bitsandbytes run the NF4 one."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoints import make_llama_checkpoint
from hf_checkpoints import generic_bitsandbytes_path
from quantize_reference import LEVELS, numpy_int8, numpy_nf4
from qconvert.convert import ConvertOptions, convert

torch = pytest.importorskip("torch")

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # down_proj has in = 102, not a multiple of 4: the last int32 word of each row is half padding.
    return make_llama_checkpoint(tmp_path_factory.mktemp("judge") / "src", hidden=72, heads=4, kv_heads=2,
                                 intermediate=102, vocab=96, layers=2, seed=3)


def test_compressed_tensors_decompresses_int8_to_q_times_scale(llama, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file as load_torch

    out = tmp_path / "int8"
    convert(str(llama), out, ConvertOptions(scheme="int8"))
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    stored = load_torch(str(out / "model.safetensors"))
    src = load_file(str(llama / "model.safetensors"))
    for i in range(2):
        for linear in LINEARS:
            m = f"model.layers.{i}.{linear}"
            state = {k: stored[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
            weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
            q, scale = numpy_int8(src[f"{m}.weight"], np.float32)
            np.testing.assert_array_equal(weight.numpy(), q.astype(np.float32) * scale)


def _float_llama(folder, weights):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(str(folder))
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    return model


@pytest.mark.parametrize("double_quant", [False, True])
def test_transformers_bitsandbytes_load_nf4_and_match_the_dequantized_float_model(llama, tmp_path, double_quant):
    from transformers import AutoModelForCausalLM
    import bitsandbytes

    out = tmp_path / "nf4"
    convert(str(llama), out, ConvertOptions(scheme="nf4", double_quant=double_quant))
    quantized = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(quantized.model.layers[0].mlp.up_proj, bitsandbytes.nn.Linear4bit)
    # These awkward shapes (72, 102) are on purpose; judge with bitsandbytes' generic dequantize path, the
    # same on every CPU (hf_checkpoints.generic_bitsandbytes_path).
    generic_bitsandbytes_path(quantized)

    src = load_file(str(llama / "model.safetensors"))
    stored = load_file(str(out / "model.safetensors"))
    dequantized = dict(src)
    for i in range(2):
        for linear in LINEARS:
            m = f"model.layers.{i}.{linear}"
            w = src[f"{m}.weight"]
            packed, absmax = numpy_nf4(w)
            if double_quant:  # the absmax bitsandbytes will decode, by the FORMATS.md formula
                state = json.loads(stored[f"{m}.weight.quant_state.bitsandbytes__nf4"].tobytes())
                codes, nested = stored[f"{m}.weight.absmax"], stored[f"{m}.weight.nested_absmax"]
                absmax = (stored[f"{m}.weight.nested_quant_map"][codes] * nested[np.arange(codes.size) // 256]
                          + np.float32(state["nested_offset"]))
            codes = np.stack([packed >> 4, packed & 15], axis=-1).reshape(-1)[: w.size]
            blocks = np.repeat(absmax, 64)[: w.size]
            dequantized[f"{m}.weight"] = (LEVELS[codes] * blocks).reshape(w.shape).astype(np.float32)
    reference = _float_llama(llama, dequantized)
    float_model = _float_llama(llama, src)

    input_ids = torch.tensor([[1, 5, 17, 42, 7, 88, 3, 60]])
    with torch.no_grad():
        got = quantized(input_ids).logits.float().numpy()
        want = reference(input_ids).logits.numpy()
        unquantized = float_model(input_ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    # The comparison can fail: NF4 does move the logits away from the float model's.
    assert np.max(np.abs(unquantized - want)) > 100 * np.max(np.abs(got - want))
