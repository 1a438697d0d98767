"""The Gemma 2 / Gemma 3 JAX forward matches transformers (float32), and its smoothing groups keep it unchanged."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gemma_checkpoints import GEMMA2, GEMMA3, make_gemma_checkpoint, read_config, reference_logits  # noqa: E402
from qconvert.formats.errors import InvalidCheckpointError  # noqa: E402
from qconvert.models import GemmaModel, build  # noqa: E402
from qconvert.calibration.layers import forward_layerwise  # noqa: E402
from qconvert.methods.fold import apply_fold, tensor_folds  # noqa: E402
from qconvert.methods.smooth import group_scales  # noqa: E402

# Measured max abs diff ~3e-6 on logits of scale ~2.5 (both families).
RTOL = 1e-5
FAMILIES = {"gemma2": GEMMA2, "gemma3": GEMMA3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def gemma(request, tmp_path_factory):
    folder = make_gemma_checkpoint(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])
    config = read_config(folder)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config["vocab_size"], size=(2, 12))  # 12 tokens > the sliding window of 4
    mask = np.ones_like(ids)
    mask[0, -3:] = 0
    params = load_file(str(folder / "model.safetensors"))
    return request.param, folder, config, params, ids, mask, reference_logits(folder, ids, mask)


def _max_err(got, expected, mask):
    valid = mask.astype(bool)
    return float(np.abs(np.asarray(got)[valid] - expected[valid]).max()), float(np.abs(expected[valid]).max())


def test_logits_match_transformers_float32(gemma):
    _, _, config, params, ids, mask, expected = gemma
    model = build(config)
    assert isinstance(model, GemmaModel)
    err, scale = _max_err(jax.jit(model.forward)(params, ids, mask), expected, mask)
    assert err <= RTOL * scale, (err, scale)
    if model.args.qk_norm:  # once: the layer-by-layer runner (calibration's and verify's way) agrees
        err, scale = _max_err(forward_layerwise(model, params, ids, mask, batch_size=1), expected, mask)
        assert err <= RTOL * scale, (err, scale)


def test_sliding_windows_soft_caps_and_local_rope_each_change_the_logits(gemma):
    # Each feature the parity test covers must matter on this model: without it the
    # forward would be far from transformers, so parity proves it is right.
    family, _, config, params, ids, mask, expected = gemma
    model = build(config)
    args = model.args
    variants = {"no sliding window": dataclasses.replace(args, sliding_window=None)}
    if family == "gemma2":
        assert args.attn_logit_softcapping and args.final_logit_softcapping
        variants["no attention soft-cap"] = dataclasses.replace(args, attn_logit_softcapping=None)
        variants["no final soft-cap"] = dataclasses.replace(args, final_logit_softcapping=None)
    else:
        assert args.qk_norm and args.ropes[0] != args.ropes[1]
        variants["global RoPE everywhere"] = dataclasses.replace(args, ropes=(args.ropes[1],) * 3)
    for what, changed in variants.items():
        err, scale = _max_err(GemmaModel(changed).forward(params, ids, mask), expected, mask)
        assert err > 100 * RTOL * scale, f"{what}: the logits moved only {err}"


def test_expected_shapes_name_every_checkpoint_tensor_with_its_shape(gemma):
    _, _, config, params, *_ = gemma
    expected = build(config).expected_shapes()
    assert expected == {name: tuple(a.shape) for name, a in params.items()}


def test_legacy_gemma3_config_keys_give_the_same_ropes():
    # Configs written before transformers 5: rope_theta / rope_scaling for global layers,
    # rope_local_base_freq for sliding ones, sliding_window_pattern instead of layer_types.
    fields = {k: v for k, v in GEMMA3.items() if k not in ("rope_parameters", "layer_types", "architectures")}
    legacy = {**fields, "num_hidden_layers": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 6}
    args = GemmaModel.from_config(legacy).args
    assert args.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    current = GemmaModel.from_config({**GEMMA3, "num_hidden_layers": 2,
                                      "layer_types": ["sliding_attention", "full_attention"]}).args
    assert (args.ropes[0], args.ropes[5]) == current.ropes


@pytest.mark.parametrize("change, key", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": "96"}, "hidden_size"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": -1}, "sliding_window"),
])
def test_inconsistent_config_is_an_invalid_checkpoint_naming_the_key(change, key):
    with pytest.raises(InvalidCheckpointError, match=key):
        build({**GEMMA2, **change})


def test_smoothing_folds_into_one_plus_w_and_leaves_transformers_logits_unchanged(gemma):
    family, folder, config, params, ids, mask, expected = gemma
    model = build(config)
    groups = model.smoothing_groups() + model.linear_smoothing_groups()
    assert [g.source.rsplit(".", 1)[1] for g in groups[:2]] == ["input_layernorm", "pre_feedforward_layernorm"]
    rng = np.random.default_rng(0)
    scales = []
    for g in groups:
        weights = [params[f"{m}.weight"] for m in g.linears]
        act_absmax = rng.uniform(0.1, 20.0, size=weights[0].shape[1]).astype(np.float32)
        scales.append(group_scales(g, act_absmax, weights, alpha=0.85))
    folds = tensor_folds(scales)
    smoothed = {name: apply_fold(a, folds[name]) if name in folds else a for name, a in params.items()}
    norm = "model.layers.0.input_layernorm.weight"
    s = scales[0].source_scales
    # The gain 1 + w is what divides by s (a fold into w alone would leave the 1 unscaled).
    np.testing.assert_allclose(1 + smoothed[norm], (1 + params[norm]) / s, rtol=1e-5, atol=1e-6)
    assert np.abs(s - 1).max() > 0.5
    got = reference_logits(folder, ids, mask, weights=smoothed)
    err, scale = _max_err(got, expected, mask)
    assert err <= 1e-4 * scale, (err, scale)


def test_bf16_embeddings_are_scaled_in_bf16_as_transformers_does():
    # sqrt(3072) = 55.43 rounds to 55.5 in bf16, and the product is rounded to bf16 too.
    import ml_dtypes

    args = dataclasses.replace(GemmaModel.from_config(GEMMA2).args, hidden_size=3072)
    table = np.random.default_rng(0).standard_normal((4, 3072)).astype(ml_dtypes.bfloat16)
    got = np.asarray(GemmaModel(args).embed({"model.embed_tokens.weight": table}, np.array([[2, 0, 3]])))
    rows = torch.from_numpy(table.astype(np.float32)[[2, 0, 3]]).to(torch.bfloat16)
    expected = (rows * torch.tensor(3072 ** 0.5).to(torch.bfloat16)).float().numpy()
    np.testing.assert_array_equal(got[0], expected)
    assert not np.array_equal(got[0], table.astype(np.float32)[[2, 0, 3]] * np.float32(3072 ** 0.5))
