"""gpt-oss (tiny, built and saved by transformers: sliding and full attention layers with sinks, biased experts
fused as transformers stores them): qconvert's float forward against transformers' logits, whole and layer by
layer; the conversion of the float release and of its MXFP4 form (experts as blocks and scales, as the shipped
checkpoint stores them), calibrated by GPTQ and AWQ, through verify and back into transformers as
GptOssForCausalLM."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_helpers import run
from gpt_oss_checkpoints import make_gpt_oss_checkpoint, write_dequantized_copy, write_mxfp4_source
from hf_checkpoints import load_config, reference_logits, token_batch
from peer_references import cosine, max_rel
from qconvert.calibration.layers import forward_layerwise
from qconvert.models import build
from qconvert.models.gpt_oss import GptOssModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CALIB = ("--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16")
# A tiny random model: what these ceilings hold is the forward and the kernels, not quality.
TINY_MODEL_QUALITY = ("--max-kl", "1.0", "--min-top1", "0.4", "--max-ppl-ratio", "1.5")


def assert_logits_close(got, expected, mask, rtol):
    valid = np.asarray(mask).astype(bool)
    scale = np.abs(expected[valid]).max()
    err = np.abs(np.asarray(got)[valid] - expected[valid]).max()
    assert err <= rtol * scale, f"max abs diff {err} vs logits scale {scale}"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The float32 checkpoint (for the exact forward check), the bfloat16 release and its MXFP4 form."""
    root = tmp_path_factory.mktemp("gpt_oss")
    fp32 = make_gpt_oss_checkpoint(root / "fp32", dtype="float32")
    bf16 = make_gpt_oss_checkpoint(root / "bf16" / "model", dtype="bfloat16")
    mxfp4 = write_mxfp4_source(bf16, root / "mxfp4" / "model")
    return {"fp32": fp32, "bf16": bf16, "mxfp4": mxfp4, "copy": write_dequantized_copy(mxfp4, root / "copy" / "model")}


def test_logits_match_transformers_whole_and_layer_by_layer(release):
    folder = release["fp32"]
    config, params = load_config(folder), load_file(str(folder / "model.safetensors"))
    ids, mask = token_batch(config["vocab_size"], seq=12)  # longer than the window of 8: the sliding layer cuts
    expected = reference_logits(folder, ids, mask)
    model = build(config)
    assert type(model) is GptOssModel and model.args.sliding_windows == (8, None)
    assert model.expected_shapes() == {name: tuple(a.shape) for name, a in params.items()}
    assert_logits_close(jax.jit(model.forward)(params, ids, mask), expected, mask, 1e-5)
    assert_logits_close(forward_layerwise(model, params, ids, mask, batch_size=1), expected, mask, 1e-5)


def test_the_quantized_linears_are_the_attention_projections(release):
    config, params = load_config(release["bf16"]), load_file(str(release["bf16"] / "model.safetensors"))
    linears = build(config).linear_names(params)
    assert linears == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")


def meant_folder(out, folder):
    """The float model folder `out` stands for: its own tensors (the float experts, norms, router), each quantized
    linear replaced by qconvert's own dequantization of it, its config without the quantization_config."""
    from safetensors.numpy import save_file

    from qconvert.formats.layouts import open_quantized

    quantized = open_quantized(out)
    modules = set(quantized.quantized_modules)
    weights = {name: a for name, a in load_file(str(out / "model.safetensors")).items()
               if name.rsplit(".", 1)[0] not in modules or name.endswith(".bias")}
    for module in quantized.quantized_modules:
        weights[f"{module}.weight"] = np.asarray(quantized.qarray(module).dequantize(np.float32))
    quantized.close()
    folder.mkdir()
    config = {k: v for k, v in load_config(out).items() if k != "quantization_config"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("form, scheme, flags, floor", [
    ("mxfp4", "int4", ("--gptq", *CALIB), 0.9),
    ("mxfp4", "int8", (), 0.998),
    ("bf16", "int4", ("--awq", "--no-gptq", *CALIB), 0.9),
], ids=["mxfp4-int4-gptq", "mxfp4-int8", "bf16-int4-awq"])
def test_converts_passes_verify_and_loads_back_in_transformers(release, tmp_path, capsys, form, scheme, flags,
                                                                floor):
    out = tmp_path / "out"
    code, _, err = run(["quantize", str(release[form]), "-o", str(out), "--scheme", scheme, "-q", *flags], capsys)
    assert code == 0, err
    record = json.loads((out / "qconvert.json").read_text())
    assert record["source"].get("format") == ("gpt-oss-mxfp4" if form == "mxfp4" else None)
    # The float fused experts are named in the loaders' ignore list (vLLM builds them as a MoE layer).
    assert r"re:model\.layers\.[0-9]+\.mlp\.experts" in load_config(out)["quantization_config"]["ignore"]
    code, report, err = run(["verify", str(out), "--quick", "--json", *TINY_MODEL_QUALITY], capsys)
    assert code == 0, err
    assert json.loads(report)["passed"] is True
    ids, mask = token_batch(load_config(release["bf16"])["vocab_size"], seq=12)
    loaded = reference_logits(out, ids, mask)
    assert transformers.AutoConfig.from_pretrained(str(out)).architectures == ["GptOssForCausalLM"]
    # transformers runs what qconvert wrote: the float model holding qconvert's own dequantized linears.
    assert max_rel(loaded, reference_logits(meant_folder(out, tmp_path / "meant"), ids, mask), mask) <= 1e-4
    # and it is close to the float model: the MXFP4 release as transformers dequantizes it, or the bf16 one.
    assert cosine(loaded, reference_logits(release[form], ids, mask), mask) >= floor


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--scheme", "int8"], ["--scheme", "int4", "--gptq", *CALIB],
                                  ["--scheme", "w8a8", *CALIB]], ids=["int8", "int4-gptq", "w8a8"])
def test_the_mxfp4_release_converts_as_its_dequantized_copy(release, tmp_path, capsys, args):
    """Byte for byte, calibration included: the MXFP4 form read while streaming is the float checkpoint
    transformers dequantizes it to."""
    for src, name in ((release["mxfp4"], "from-mxfp4"), (release["copy"], "from-copy")):
        code, _, err = run(["quantize", str(src), "-o", str(tmp_path / name), "-q", *args], capsys)
        assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "from-mxfp4").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "from-copy").iterdir())
    for name in names:
        if name not in ("qconvert.json", "README.md"):
            assert (tmp_path / "from-mxfp4" / name).read_bytes() == (tmp_path / "from-copy" / name).read_bytes(), name
    records = [json.loads((tmp_path / n / "qconvert.json").read_text()) for n in ("from-mxfp4", "from-copy")]
    assert records[0]["source"]["format"] == "gpt-oss-mxfp4"
    for record in records:
        del record["source"], record["files"]["README.md"]
    assert records[0] == records[1]


# gpt-oss-20b's config.json as released (without its quantization_config): rope_scaling in the earlier spelling,
# no swiglu_alpha (transformers' default 1.702), layer_types starting sliding.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088}


def test_the_released_config_reads_as_transformers_reads_it():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from qconvert.models.rope import attention_factor, inverse_frequencies

    hf = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items() if k not in ("architectures", "model_type")})
    rotary = GptOssRotaryEmbedding(hf)
    model = build(GPT_OSS_20B)
    np.testing.assert_allclose(inverse_frequencies(model.args.rope, 64), rotary.inv_freq.numpy(), rtol=1e-6)
    assert attention_factor(model.args.rope) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert model.args.sliding_windows == (128, None) * 12 and model.args.attention_bias
    assert (model.moe.swiglu_alpha, model.moe.swiglu_limit) == (hf.swiglu_alpha, hf.swiglu_limit)
    assert model.expected_shapes()["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert model.expected_shapes()["model.layers.0.self_attn.q_proj.weight"] == (4096, 2880)


@pytest.mark.parametrize("edit, words", [
    ({"layer_types": ["sliding_attention"] * 3}, "config.json: layer_types is"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, "config.json: layer_types is"),
    ({"num_experts_per_tok": 33}, "num_experts_per_tok = 33 exceeds num_local_experts = 32"),
])
def test_a_config_that_does_not_fit_is_refused_naming_the_key(edit, words):
    from qconvert.formats.errors import InvalidCheckpointError

    with pytest.raises(InvalidCheckpointError, match=words):
        build({**GPT_OSS_20B, **edit})
