"""--scheme w8a8 end to end: smoothing beats plain W8A8 on outliers, keeps the float model, writes static scales and records."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from safetensors.numpy import load_file, save_file

from qconvert.calibration.data import load_calibration
from qconvert.calibration.observer import open_params
from qconvert.calibrate import calibrate_model
from qconvert.convert import ConvertOptions, convert
from qconvert.formats.layouts import open_quantized
from qconvert.formats.qarray import QArray
from qconvert.models import build, dense_linear
from qconvert.options import CalibrationOptions
from qconvert.source.resolve import open_source, resolve_source
from qconvert.methods.recipe import prepare_adjustments

OUTLIERS = (3, 17)
OUTLIER_SCALE = 100.0


def int8_per_token(x):
    """Simulated int8 activations: symmetric, one scale per token (row), round half to even."""
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0, 1e-12)
    return jnp.clip(jnp.round(x / scale), -127, 127) * scale


def w8a8_linear(name, x, weight, bias):
    """The test's own simulated W8A8: per-token int8 x times the file's per-channel int8 weight."""
    if not isinstance(weight, QArray):
        return dense_linear(name, x, weight, bias)  # lm_head stays float (the layout's `ignore`)
    w = jnp.asarray(weight.qvalue, jnp.float32) * jnp.asarray(weight.scale, jnp.float32)
    y = jnp.matmul(int8_per_token(x.astype(jnp.float32)), w.T, precision=jax.lax.Precision.HIGHEST)
    return y if bias is None else y + jnp.asarray(bias, jnp.float32)


def quantized_params(folder):
    """The converted folder as forward params: float tensors as arrays, linears as QArrays."""
    q = open_quantized(folder)
    params = {name: np.asarray(q.get(name)) for name in q.float_names}
    params.update({f"{m}.weight": q.qarray(m) for m in q.quantized_modules})
    return params


def convert_w8a8(src, out, *, act="dynamic", scale_search=None, gptq=False, **flags):
    # Round-to-nearest unless a test asks for GPTQ: these tests are about smoothing and the scales.
    options = ConvertOptions(scheme="w8a8", act=act, scale_search=scale_search, gptq=gptq, calibration=CalibrationOptions(**flags))
    return convert(str(src), out, options)


def w8a8_adjustments(folder, *, act="dynamic", **flags):
    """The w8a8 stage alone, on the folder opened as the pipeline opens it."""
    options = ConvertOptions(scheme="w8a8", act=act, calibration=CalibrationOptions(**flags))
    return prepare_adjustments(open_source(resolve_source(str(folder))), options)


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory):
    """A tiny Llama whose norm outputs carry two outlier channels (x100), as trained LLMs' do.

    As in trained models, the weights reading those channels are small (here /100),
    so the outliers do not dominate the float output: they only wreck the
    activations' int8 grid, which is what smoothing is for.
    """
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("outlier"), outlier_channels=OUTLIERS,
                                   outlier_scale=OUTLIER_SCALE)
    tensors = load_file(str(folder / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                          "up_proj.weight")):
            w[:, list(OUTLIERS)] /= OUTLIER_SCALE
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    ids = jnp.asarray(np.random.default_rng(7).integers(0, config["vocab_size"], (2, 32)))
    # Calibrate once (`qconvert calibrate`) and reuse the statistics (--act-stats) below:
    # each calibration compiles every layer anew.
    # Beside the model, not inside it: a *.safetensors in the folder would be read as part of the weights.
    stats = tmp_path_factory.mktemp("outlier-stats") / "stats.safetensors"
    calibrate_model(str(folder), stats, calib="random", samples=8, seqlen=32)
    return folder, config, ids, stats


def relative_error(y, ref):
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))


def test_smoothing_cuts_w8a8_error_on_outlier_channels(outlier_llama, tmp_path):
    folder, config, ids, stats = outlier_llama
    model = build(config)
    reference = model.forward(open_params(folder), ids)
    convert_w8a8(folder, tmp_path / "smooth", act_stats=stats)
    convert_w8a8(folder, tmp_path / "plain", smooth=False)
    err_smooth = relative_error(model.forward(quantized_params(tmp_path / "smooth"), ids,
                                              linear=w8a8_linear), reference)
    err_plain = relative_error(model.forward(quantized_params(tmp_path / "plain"), ids,
                                             linear=w8a8_linear), reference)
    # Measured on this checkpoint: plain 0.083, smoothed 0.0034, a ratio of ~24.
    # Require at least 10.
    assert err_smooth * 10 < err_plain, (err_smooth, err_plain)
    assert err_smooth < 0.01


def test_smoothing_alone_leaves_the_float_model_unchanged(outlier_llama):
    folder, config, ids, stats = outlier_llama
    model, params = build(config), open_params(folder)
    raw = {name: np.asarray(params[name]) for name in params}
    adjustments = w8a8_adjustments(folder, act_stats=stats)
    smoothed = {name: adjustments.weight_transform(name, array) for name, array in raw.items()}
    assert not np.allclose(smoothed["model.layers.0.input_layernorm.weight"],
                           raw["model.layers.0.input_layernorm.weight"])
    assert not np.allclose(smoothed["model.layers.0.mlp.up_proj.weight"], raw["model.layers.0.mlp.up_proj.weight"])
    reference = model.forward(raw, ids)
    np.testing.assert_allclose(model.forward(smoothed, ids), reference, rtol=1e-4,
                               atol=1e-5 * float(jnp.max(jnp.abs(reference))))


def calibration_maxima(model, params, ids):
    """max|x| of every linear's input over the calibration ids, recorded by the test itself."""
    recorded = {}

    def recording(name, x, weight, bias):
        m = np.abs(np.asarray(x, np.float32).reshape(-1, x.shape[-1])).max(0)
        recorded[name] = np.maximum(recorded.get(name, 0), m)
        return dense_linear(name, x, weight, bias)

    with jax.disable_jit():
        model.forward({k: np.asarray(params[k]) for k in params}, jnp.asarray(ids), linear=recording)
    return recorded


def test_static_activations_write_input_scale(outlier_llama, tmp_path):
    folder, config, _, stats = outlier_llama
    model, params = build(config), open_params(folder)
    ids = load_calibration("random", folder, config, samples=8, seqlen=32).input_ids
    maxima = calibration_maxima(model, params, ids)

    convert_w8a8(folder, tmp_path / "plain", act="static", smooth=False, act_stats=stats)
    plain = open_quantized(tmp_path / "plain")
    acts = json.loads((tmp_path / "plain" / "config.json").read_text())["quantization_config"]
    acts = acts["config_groups"]["group_0"]["input_activations"]
    assert acts["strategy"] == "tensor" and acts["dynamic"] is False
    assert len(plain.quantized_modules) == 14
    for module in plain.quantized_modules:
        assert plain.input_scale(module) == pytest.approx(maxima[module].max() / 127, rel=1e-5), module

    convert_w8a8(folder, tmp_path / "smooth", act="static", act_stats=stats)
    smooth = open_quantized(tmp_path / "smooth")
    for layer in range(2):
        for norm, linear in (("input_layernorm", "self_attn.q_proj"), ("post_attention_layernorm", "mlp.up_proj")):
            p = f"model.layers.{layer}"
            s = params[f"{p}.{norm}.weight"] / smooth.get(f"{p}.{norm}.weight")  # what the norm absorbed
            expected = (maxima[f"{p}.{linear}"] / s).max() / 127
            assert smooth.input_scale(f"{p}.{linear}") == pytest.approx(expected, rel=1e-4)
            # smoothing shrank the outliers, so the per-tensor scale is far finer
            assert smooth.input_scale(f"{p}.{linear}") < plain.input_scale(f"{p}.{linear}") / 5


def test_qconvert_json_records_alpha_per_group_and_calibration(outlier_llama, tmp_path):
    folder, _, _, stats = outlier_llama
    convert_w8a8(folder, tmp_path / "out", alpha="0.6,post_attention_layernorm=0.7,mlp.up_proj=0.4",
                 act_stats=stats)
    manifest = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    calibration, smoothing = manifest["calibration"], manifest["smoothing"]
    assert calibration["source"] == "random" and calibration["random"] is True
    assert "random token ids" in calibration["description"]
    assert calibration["tokens"] == 8 * 32
    assert smoothing["alpha"] == {
        "model.layers.0.input_layernorm": 0.6, "model.layers.1.input_layernorm": 0.6,
        "model.layers.0.post_attention_layernorm": 0.7, "model.layers.1.post_attention_layernorm": 0.7,
        "model.layers.0.self_attn.v_proj": 0.6, "model.layers.1.self_attn.v_proj": 0.6,
        "model.layers.0.mlp.up_proj": 0.4, "model.layers.1.mlp.up_proj": 0.4,
    }
    assert smoothing["groups"]["model.layers.0.self_attn.v_proj"] == ["model.layers.0.self_attn.o_proj"]
    assert calibration["stats_file"]["name"] == "stats.safetensors"
    assert manifest["flags"]["act"] == "dynamic"


def test_no_smooth_dynamic_needs_no_calibration(outlier_llama, tmp_path):
    folder, _, _, stats = outlier_llama
    convert_w8a8(folder, tmp_path / "out", smooth=False)
    manifest = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    assert manifest["calibration"] is None and manifest["smoothing"] is None


def test_mixtral_experts_are_calibrated_and_smoothed_without_changing_the_model(tmp_path):
    from checkpoints import make_mixtral_checkpoint

    folder = make_mixtral_checkpoint(tmp_path / "mixtral")
    config = json.loads((folder / "config.json").read_text())
    params = open_params(folder)
    raw = {name: np.asarray(params[name]) for name in params}
    adjustments = w8a8_adjustments(folder, act="static", calib="random", calib_samples=4, calib_seqlen=16)
    # every expert linear got a static scale from the tokens routed to it
    experts = [m for m in adjustments.input_scales if ".experts." in m]
    assert len(experts) == 2 * 4 * 3 and all(adjustments.input_scales[m] > 0 for m in experts)
    # the router's columns are smoothed with the experts', so routing and output stay the same
    assert "model.layers.0.block_sparse_moe.gate.weight" in adjustments.folds
    model = build(config)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config["vocab_size"], (2, 16)))
    smoothed = {name: adjustments.weight_transform(name, array) for name, array in raw.items()}
    reference = model.forward(raw, ids)
    np.testing.assert_allclose(model.forward(smoothed, ids), reference, rtol=1e-4,
                               atol=1e-5 * float(jnp.max(jnp.abs(reference))))


def test_default_flags_search_alpha_and_clip_weights_only_when_asked(outlier_llama, tmp_path):
    folder, config, ids, _ = outlier_llama
    convert_w8a8(folder, tmp_path / "default", calib="random", calib_samples=4, calib_seqlen=32, gptq=None)
    convert_w8a8(folder, tmp_path / "searched", calib="random", calib_samples=4, calib_seqlen=32, scale_search=True)
    convert_w8a8(folder, tmp_path / "family", calib="random", calib_samples=4, calib_seqlen=32,
                 alpha="family", scale_search=False)
    manifest = json.loads((tmp_path / "default" / "qconvert.json").read_text())
    # GPTQ is opt-in for w8a8: on real LLMs it cost perplexity after smoothing (docs/ACCURACY.md)
    assert manifest["rounding"]["method"] == "rtn"
    smoothing = manifest["smoothing"]
    assert smoothing["alpha_mode"] == "auto"
    for source, tried in smoothing["alpha_search"].items():
        # the recorded alpha is the grid point with the least recorded error
        assert smoothing["alpha"][source] == float(min(tried, key=lambda a: (tried[a], float(a))))
    # the clip search is opt-in: on real LLMs it cost perplexity (docs/ACCURACY.md)
    assert manifest["flags"]["scale_search"] is False and manifest["scale_search"] is None
    searched = json.loads((tmp_path / "searched" / "qconvert.json").read_text())
    assert searched["flags"]["scale_search"] is True
    modules = searched["scale_search"]["modules"]
    assert len(modules) == 14
    for record in modules.values():
        assert record["weight_clip"]["objective"] == "output error"
        assert record["weight_clip"]["error_searched"] <= record["weight_clip"]["error_plain"]
    family = json.loads((tmp_path / "family" / "qconvert.json").read_text())
    assert set(family["smoothing"]["alpha"].values()) == {0.85} and family["scale_search"] is None
    # the defaults give a whole-model output at least as close to float as the family alpha does
    model = build(config)
    reference = model.forward(open_params(folder), ids)
    err_default = relative_error(model.forward(quantized_params(tmp_path / "default"), ids, linear=w8a8_linear),
                                 reference)
    err_family = relative_error(model.forward(quantized_params(tmp_path / "family"), ids, linear=w8a8_linear),
                                reference)
    assert err_default <= err_family * 1.05, (err_default, err_family)


def test_act_stats_without_alpha_falls_back_to_the_family_value(outlier_llama, tmp_path):
    folder, _, _, stats = outlier_llama
    convert_w8a8(folder, tmp_path / "out", act_stats=stats)
    smoothing = json.loads((tmp_path / "out" / "qconvert.json").read_text())["smoothing"]
    assert smoothing["alpha_mode"].startswith("family default")
    assert set(smoothing["alpha"].values()) == {0.85}


def test_static_input_scales_are_searched_on_calibration_rows(outlier_llama, tmp_path):
    folder, config, _, _ = outlier_llama
    convert_w8a8(folder, tmp_path / "out", act="static", calib="random", calib_samples=4, calib_seqlen=32,
                 scale_search=True)
    q = open_quantized(tmp_path / "out")
    record = json.loads((tmp_path / "out" / "qconvert.json").read_text())["scale_search"]
    assert record["input_scale"]["grid"][0] == 1.0
    for module in q.quantized_modules:
        r = record["modules"][module]["input_scale"]
        assert r["error_searched"] <= r["error_max"]
        assert r["ratio_to_max"] in record["input_scale"]["grid"]


def test_no_scale_search_keeps_static_input_scales_at_the_calibrated_max(outlier_llama, tmp_path):
    folder, config, _, _ = outlier_llama
    model, params = build(config), open_params(folder)
    ids = load_calibration("random", folder, config, samples=4, seqlen=32).input_ids
    maxima = calibration_maxima(model, params, ids)
    # the default: no search; round to nearest, so that every layer sees the float model's inputs
    convert_w8a8(folder, tmp_path / "out", act="static", smooth=False, calib="random", calib_samples=4,
                 calib_seqlen=32, gptq=False)
    q = open_quantized(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "qconvert.json").read_text())["scale_search"] is None
    for module in q.quantized_modules:
        assert q.input_scale(module) == pytest.approx(maxima[module].max() / 127, rel=1e-5), module
