"""transformers and gpt-oss folders: the fp8, nvfp4a16 and mxfp4a16 folders (attention quantized, experts float)
load back as GptOssForCausalLM and compute what qconvert wrote, close to the float model; and transformers reads no
quantized gpt-oss expert in any form a peer writes (vLLM's per-expert names, compressed-tensors modules of one fused
gate_up_proj per expert, llm-compressor's linearized gate/up/down): its GptOssExperts are fused parameters, not
linears, and its conversion mapping has no gpt-oss entry to merge per-expert tensors into them. This is why qconvert
keeps gpt-oss's experts float in every scheme."""

from __future__ import annotations

import numpy as np
import pytest

from cli_helpers import run
from gpt_oss_checkpoints import make_gpt_oss_checkpoint, write_int4_experts
from hf_checkpoints import dequantized_float_folder, load_config, reference_logits, token_batch
from peer_references import cosine, max_rel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "bf16", hidden=128, intermediate=128)


def fp8_per_token(x):
    """x rounded to E4M3 on one scale (absmax / 448) per token: compressed-tensors' dynamic `token` strategy."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 448.0
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def logits(folder, ids, mask, dtype, fp8_inputs=()):
    """transformers' logits of `folder`, the linears named in `fp8_inputs` reading their inputs rounded by
    fp8_per_token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    assert type(model).__name__ == "GptOssForCausalLM"
    named = dict(model.named_modules())
    for name in fp8_inputs:
        named[name].register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                     attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("scheme, floor", [("fp8", 0.98), ("nvfp4a16", 0.95), ("mxfp4a16", 0.95)])
def test_fp8_and_fp4_folders_load_back_in_transformers(source, tmp_path, capsys, scheme, floor):
    from qconvert.formats.layouts import open_quantized

    out = tmp_path / scheme
    rtn = [] if scheme == "fp8" else ["--no-gptq"]  # the FP4 schemes' round-to-nearest
    code, _, err = run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *rtn], capsys)
    assert code == 0, err
    ids, mask = token_batch(load_config(source)["vocab_size"], seq=12)
    # compressed-tensors decompresses FP4 weights to bf16 whatever the model's dtype: FP4 folders run in bf16.
    dtype = torch.float32 if scheme == "fp8" else torch.bfloat16
    loaded = logits(out, ids, mask, dtype)
    # fp8 rounds the attention's inputs per token (dynamic E4M3 activations) as it runs.
    rounded = [m for m in open_quantized(out).quantized_modules] if scheme == "fp8" else []
    assert len(rounded) == (8 if scheme == "fp8" else 0)
    meant = logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask, dtype, rounded)
    assert max_rel(loaded, meant, mask) <= (1e-4 if scheme == "fp8" else 1e-3)
    assert cosine(loaded, reference_logits(source, ids, mask), mask) >= floor


@pytest.mark.parametrize("form", ["vllm", "modules", "linear"])
@pytest.mark.parametrize("dequantize", [False, True], ids=["compressed", "dequantize"])
def test_transformers_reads_no_quantized_expert(source, tmp_path, capsys, form, dequantize):
    out = tmp_path / "int4"
    code, _, err = run(["quantize", str(source), "-o", str(out), "--scheme", "int4", "-q", "--no-awq", "--no-gptq"],
                       capsys)
    assert code == 0, err
    write_int4_experts(out, form)
    config = transformers.CompressedTensorsConfig(dequantize=True) if dequantize else None
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.bfloat16, output_loading_info=True,
        **({"quantization_config": config} if config else {}))
    missing = set(info["missing_keys"])
    assert {f"model.layers.{i}.mlp.experts.{t}" for i in range(2) for t in FUSED} <= missing
    assert all(".mlp.experts." in key for key in missing)  # the attention's int4 linears do load
    assert any(".mlp.experts.0." in key for key in info["unexpected_keys"])
