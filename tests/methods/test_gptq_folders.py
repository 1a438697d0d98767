"""GPTQ folders end to end: NF4 rounded by GPTQ is still a bitsandbytes folder, qconvert.json says how each
folder was rounded, and the GPTQ flags refuse what does not fit."""

from __future__ import annotations

import json

import numpy as np

from qconvert.calibration.statistics import InputHessian
import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli
from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_source(tmp_path_factory.mktemp("llama"), "llama")


def quantize(source, out, capsys, *flags):
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "-q", *flags], capsys)
    assert code == 0, err
    return json.loads((out / "qconvert.json").read_text())


def test_nf4_gptq_folder_loads_in_bitsandbytes_as_its_own_dequantization(llama, tmp_path, capsys):
    import bitsandbytes
    import transformers

    out = tmp_path / "nf4"
    record = quantize(llama, out, capsys, "--scheme", "nf4", "--gptq", *CALIB)
    rounding = record["rounding"]
    assert rounding["method"] == "gptq" and rounding["damp"] == 0.1 and rounding["block_size"] == 128
    errors = rounding["modules"].values()
    assert len(errors) == 7 and all(e["error_gptq"] < e["error_rtn"] for e in errors)
    loaded_model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(loaded_model.model.layers[0].mlp.down_proj, bitsandbytes.nn.Linear4bit)
    ids, mask = token_batch(load_config(llama)["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # transformers + bitsandbytes reading the folder
    meant = reference_logits(dequantized_float_folder(llama, out, tmp_path / "meant"), ids, mask)
    valid = mask.astype(bool)
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * np.abs(meant[valid]).max()


def test_round_to_nearest_is_recorded_and_gptq_changes_codes_not_scales(llama, tmp_path, capsys):
    from qconvert.formats.layouts import open_quantized

    rtn = quantize(llama, tmp_path / "rtn", capsys, "--scheme", "int8")
    gptq = quantize(llama, tmp_path / "gptq", capsys, "--scheme", "int8", "--gptq", "--gptq-act-order",
                    "--gptq-damp", "0.05", *CALIB)
    assert rtn["rounding"] == {"method": "rtn"}
    assert {k: gptq["rounding"][k] for k in ("method", "damp", "act_order")} == {
        "method": "gptq", "damp": 0.05, "act_order": True}
    a, b = open_quantized(tmp_path / "rtn"), open_quantized(tmp_path / "gptq")
    for module in a.quantized_modules:
        qa, qb = a.qarray(module), b.qarray(module)
        np.testing.assert_array_equal(np.asarray(qa.scale), np.asarray(qb.scale))
        assert np.mean(np.asarray(qa.qvalue) != np.asarray(qb.qvalue)) > 0.01


def test_two_gptq_runs_give_identical_bytes(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    first = quantize(src, tmp_path / "a", capsys, "--scheme", "w8a8", "--gptq", *CALIB)
    second = quantize(src, tmp_path / "b", capsys, "--scheme", "w8a8", "--gptq", *CALIB)
    assert first["rounding"]["method"] == "gptq"
    assert first["files"] == second["files"]


@pytest.mark.parametrize("flags,message", [
    (["--scheme", "w8a8", "--gptq", "--act-stats", "stats.safetensors"], "--gptq needs calibration activations"),
    (["--scheme", "int8", "--gptq-damp", "0.1"], "apply with GPTQ only"),
    (["--scheme", "int8", "--no-gptq-act-order"], "apply with GPTQ only"),
    (["--scheme", "int4", "--gptq-damp", "0"], "--gptq-damp must be a fraction"),
    (["--scheme", "nf4", "--calib", "random"], "also with --gptq"),
    (["--scheme", "int4", "--alpha", "0.5"], "apply to --scheme w8a8 only"),
])
def test_gptq_flags_that_do_not_fit_are_usage_errors(tmp_path, capsys, flags, message):
    src = make_llama_checkpoint(tmp_path / "src")
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), *flags], capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


def test_hessians_are_two_xtx_over_n_window_starts_left_to_qkv_shared_by_the_linears_of_one_input(tmp_path):
    import jax
    import jax.numpy as jnp

    from qconvert.calibration.observer import iter_layer_stats, open_params
    from qconvert.models import build, dense_linear

    src = make_llama_checkpoint(tmp_path / "src", layers=1)
    config, params = load_config(src), open_params(src)
    model = build(config)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (3, 16))
    wanted = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"]
    stats = next(iter_layer_stats(model, params, ids, batch_size=2, hessians=frozenset(wanted)))
    inputs = {}

    def capture(name, x, weight, bias):  # every window's first token (the attention sink) left out but for q/k/v
        start = 0 if name.endswith(("q_proj", "k_proj", "v_proj")) else 1
        inputs[name] = np.asarray(x, np.float64)[:, start:].reshape(-1, x.shape[-1])
        return dense_linear(name, x, weight, bias)

    with jax.disable_jit():
        model.forward({k: jnp.asarray(np.asarray(params[k])) for k in params}, jnp.asarray(ids), linear=capture)
    for module in wanted:
        x = inputs[module]
        expected = 2 * x.T @ x / x.shape[0]
        np.testing.assert_allclose(np.asarray(stats.of(InputHessian)[module]["hessian"]), expected, rtol=1e-4,
                                   atol=1e-5 * np.abs(expected).max())
        assert stats.of(InputHessian)[module]["tokens"] == len(x)
    assert stats.of(InputHessian)[wanted[2]]["tokens"] == ids.size - ids.shape[0]
    assert stats.of(InputHessian)[wanted[0]]["hessian"] is stats.of(InputHessian)[wanted[1]]["hessian"]  # q and k read one input: one H
    assert "model.layers.0.self_attn.v_proj" not in stats.of(InputHessian)


def test_sequential_mode_runs_each_layer_again_on_the_weights_handed_in(tmp_path):
    import jax.numpy as jnp

    from qconvert.calibration.observer import open_params
    from qconvert.models import build
    from qconvert.calibration.layers import iterate_layers

    src = make_llama_checkpoint(tmp_path / "src", layers=2)
    config, params = load_config(src), open_params(src)
    model = build(config)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 16))
    name = "model.layers.0.mlp.down_proj.weight"
    rounded = np.round(np.asarray(params[name]) * 8) / 8  # any other weight: the layer must run on it
    results = list(iterate_layers(model, params, ids, batch_size=1,
                                  replace=lambda i: {name: rounded} if i == 0 else None))
    replaced = {k: jnp.asarray(np.asarray(params[k])) for k in params}
    replaced[name] = jnp.asarray(rounded)
    hidden = model.embed(replaced, jnp.asarray(ids))
    for i in range(model.num_layers):
        hidden = model.layer(i, replaced, hidden)
        np.testing.assert_allclose(np.asarray(results[i].hidden), np.asarray(hidden), rtol=1e-4, atol=1e-5)


def _bfloat16_gemma_with_small_gains(root):
    """A bf16 Gemma 3 whose norms feeding linears hold some gains 1 + w just above 0, where the stored
    smoothed gain (1 + w) / s - 1 rounds to few bf16 steps (and s is capped)."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    from gemma_checkpoints import GEMMA3, make_gemma_checkpoint

    src = make_gemma_checkpoint(root, dict(GEMMA3, num_hidden_layers=2,
                                           layer_types=["sliding_attention", "full_attention"]), seed=3)
    tensors = load_torch(str(src / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("input_layernorm.weight", "pre_feedforward_layernorm.weight")):
            tensors[name][::6] = -1 + 2.0 ** -8
        tensors[name] = tensors[name].to(torch.bfloat16).contiguous()
    save_torch(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_gemma_w8a8_gptq_rounds_the_weights_the_stored_gains_carry(tmp_path, capsys):
    """GPTQ rounds each smoothed linear as the writer folds it, on the scales the stored norm gains really
    divide by (rounded to bf16 near -1, capped): its folder has round-to-nearest's norms and weight scales
    (GPTQ moves codes only), while its codes differ."""
    from safetensors.numpy import load_file

    src = _bfloat16_gemma_with_small_gains(tmp_path / "src")
    flags = ["--scheme", "w8a8", "--alpha", "0.5", "--calib", "random", "--calib-samples", "8",
             "--calib-seqlen", "32"]
    quantize(src, tmp_path / "rtn", capsys, *flags, "--no-gptq")
    quantize(src, tmp_path / "gptq", capsys, *flags, "--gptq")
    rtn, gptq = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("rtn", "gptq"))
    source = load_file(str(src / "model.safetensors"))
    # Layer 0 only: GPTQ is sequential, so later layers calibrate on the rounded layers' outputs.
    layer = "model.layers.0."
    smoothed = [layer + n for n in ("input_layernorm.weight", "pre_feedforward_layernorm.weight")]
    assert all(not np.array_equal(rtn[n], source[n]) for n in smoothed)
    for name in smoothed:
        np.testing.assert_array_equal(gptq[name], rtn[name])
    scales = [f"{layer}{m}.weight_scale" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj")]
    for name in scales:
        np.testing.assert_array_equal(gptq[name], rtn[name], err_msg=name)
        codes = name[: -len("_scale")]
        assert np.mean(gptq[codes] != rtn[codes]) > 0.01


@pytest.mark.parametrize("samples,seqlen,noted", [(4, 32, True), (16, 96, False)])
def test_gptq_on_few_calibration_tokens_says_so(tmp_path, capsys, samples, seqlen, noted):
    """128 tokens for inputs 128 wide (the MLP's down_proj) is under 10x: one note on stdout and in the JSON;
    1,536 tokens is not."""
    src = make_llama_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), "--scheme", "int8", "--gptq",
                              "--calib", "random", "--calib-samples", str(samples), "--calib-seqlen", str(seqlen),
                              "--json"], capsys)
    assert code == 0, err
    notes = [n for n in json.loads(out)["notes"] if n.startswith("GPTQ rounded on")]
    if noted:
        assert notes == [f"GPTQ rounded on {samples * seqlen:,} calibration tokens, fewer than 10x the widest "
                         "input it rounded (128): its codes fit that text more than text in general; --calib "
                         "with 1,280 tokens or more of text like the model's use generalizes better "
                         "(--calib-samples x --calib-seqlen)"]
    else:
        assert notes == []
    code, out, _ = run_cli(["quantize", str(src), "-o", str(tmp_path / "text"), "--scheme", "int8", "--gptq",
                            "--calib", "random", "--calib-samples", str(samples), "--calib-seqlen", str(seqlen)],
                           capsys)
    assert code == 0 and (("note: GPTQ rounded on" in out) == noted)
