"""--scheme nvfp4a16 and mxfp4a16 (compressed-tensors NVFP4A16 and MXFP4A16): every tensor byte-identical to
compressed-tensors' own quantizer and compressor on bf16, fp16 and fp32 weights, the folder's reading equal to
its decompressor, GPTQ on the E2M1 grid against a float64 reference, and a tiny Llama through quantize, the
preset's config, verify and transformers + compressed-tensors."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

import qconvert.schemes.rowwise as rowwise
from cli_helpers import run as run_cli
from fp4_references import compressed_tensors_fp4, compressed_tensors_fp4_decompressed
from linear_inputs import linear
from peer_references import cosine
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layouts import open_quantized
from qconvert.formats.qarray import FP4_LEVELS
from qconvert.methods.gptq_core import gptq_codes
from qconvert.schemes import scheme_named
from qconvert.schemes.fp4 import dequantize_fp4

pytest.importorskip("compressed_tensors")

PRESETS = [("nvfp4a16", "NVFP4A16"), ("mxfp4a16", "MXFP4A16")]
# The schemes' default (GPTQ) on random token ids: the tests' tiny models have no tokenizer.
CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"]
DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32]


def awkward_weight(dtype, rows=256, cols=1536, seed=0) -> np.ndarray:
    """A real-shaped weight with the cases the rules single out: quotients on every E2M1 tie, negative values
    that round to zero, an all-zero group and row, -0.0, one outlier, and groups far smaller than the rest."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    w[3, 5] = 0.7
    w[4, :64] = 0.0
    w[5, :] = 0.0
    w[6, :32] = np.array([6, 0.25, -0.25, 0.75, -1.25, 1.75, 2.5, -3.5, 5.0, -5.0, 0.1, -0.1, -0.0, 0.5, 1.0, 1.5,
                          6, 0.125, -0.375, 0.625, 2.25, -2.75, 3.25, 4.5, 5.5, -6, 0.0, -0.0, 1.0, 2.0, 3.0, 4.0],
                         np.float32) / 3.0
    w[7, :] *= 1e-4
    w[8, 16:48] = -1e-7
    return w.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name,preset", PRESETS)
def test_every_tensor_is_compressed_tensors_bytes(name, preset, dtype):
    w = awkward_weight(dtype)
    scheme = scheme_named(preset)  # the preset name is an alias of the scheme
    assert scheme.name == name
    q = scheme.quantize(w, LayoutFlags(), scale_dtype=None)
    ours = scheme.layout.to_tensors("m", q, LayoutFlags())
    theirs = compressed_tensors_fp4(w, preset)
    assert sorted(ours) == sorted(f"m.{k}" for k in theirs)
    for key, value in theirs.items():
        got = ours[f"m.{key}"]
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert got.tobytes() == value.tobytes(), key
    # The specs the plan writes are the tensors' own.
    specs = scheme.layout.tensor_specs("m", w.shape, np.dtype(dtype), LayoutFlags())
    assert [(s.name, np.dtype(s.dtype), tuple(s.shape)) for s in specs] == \
        [(k, v.dtype, v.shape) for k, v in ours.items()]


@pytest.mark.parametrize("magnitude", [1e-3, 3e-2, 40.0])
def test_float16_weights_small_and_large_equal_compressed_tensors(magnitude):
    # fp16's global scale 2688 / absmax overflows fp16 below absmax 0.041 (compressed-tensors then takes 1).
    w = (np.random.default_rng(2).standard_normal((64, 512)) * magnitude).astype(np.float16)
    for name, preset in PRESETS:
        scheme = scheme_named(name)
        ours = scheme.layout.to_tensors("m", scheme.quantize(w, LayoutFlags(), scale_dtype=None), LayoutFlags())
        for key, value in compressed_tensors_fp4(w, preset).items():
            assert ours[f"m.{key}"].tobytes() == value.tobytes(), (preset, key)


@pytest.mark.parametrize("name,preset", PRESETS)
def test_the_folder_reads_back_as_compressed_tensors_decompresses_it(name, preset):
    w = awkward_weight(ml_dtypes.bfloat16, rows=64, cols=512)
    scheme = scheme_named(name)
    tensors = compressed_tensors_fp4(w, preset)
    source = _Source({f"m.{k}": v for k, v in tensors.items()})
    q = scheme.layout.read_qarray(source, "m")
    theirs = compressed_tensors_fp4_decompressed(tensors, preset).float().numpy()
    # The jnp dequantize (verify's and the models' path), in bf16 as compressed-tensors' decompressor gives it.
    np.testing.assert_array_equal(np.asarray(q.dequantize(ml_dtypes.bfloat16)).astype(np.float32), theirs)
    np.testing.assert_array_equal(dequantize_fp4(q).astype(ml_dtypes.bfloat16).astype(np.float32), theirs)


class _Source(dict):
    float_dtype = "bfloat16"

    def tensor(self, name, dtypes, ndim):
        return self[name]

    def file_of(self, name):
        return "model.safetensors"


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_streamed_rows_give_the_whole_tensor_quantization(monkeypatch, name):
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 64 * 256 * 2)  # 64-row blocks of a bf16 [256, 256]
    w = awkward_weight(ml_dtypes.bfloat16, rows=256, cols=256)
    w[200, 7] = 3.0  # the tensor's absmax in a later block: NVFP4's global scale is the whole tensor's
    scheme = scheme_named(name)
    whole = scheme.quantize(w, LayoutFlags(), scale_dtype=None)
    streamed = scheme.quantize_rows(lambda a, b: w[a:b], w.shape, w.dtype, LayoutFlags())
    for leaf in ("qvalue", "scale", "zero_point"):
        a, b = getattr(whole, leaf), getattr(streamed, leaf)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def reference_gptq(*args):
    """The float64 GPTQ of tests/methods/test_gptq_core.py (the paper's algorithm written plainly)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "methods" / "test_gptq_core.py"
    spec = importlib.util.spec_from_file_location("gptq_core_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_gptq(*args)


def e2m1_round_float64(x):
    """The nearest E2M1 value in float64, a tie to the even mantissa (written from the format, not the code)."""
    magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    even = np.array([True, False, True, False, True, False, True, False])
    a = np.abs(np.clip(x, -6, 6))[:, None]
    distance = np.abs(a - magnitudes[None, :])
    best = distance.min(axis=1, keepdims=True)
    candidates = distance == best
    pick = np.where(candidates.sum(axis=1) > 1, np.argmax(candidates & even[None, :], axis=1),
                    np.argmax(candidates, axis=1))
    return np.sign(x) * magnitudes[pick]


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_gptq_codes_match_float64_reference(name):
    rng = np.random.default_rng(0)
    w, x, _ = linear(rng, 64, 512)
    scheme = scheme_named(name)
    q = scheme.quantize(w, LayoutFlags(), scale_dtype=None)
    steps = np.asarray(scheme.gptq_steps(q, LayoutFlags()), np.float64)
    h = 2 * x.astype(np.float64).T @ x / x.shape[0]
    expected = reference_gptq(w, h, steps, e2m1_round_float64)
    with jax.enable_x64(True):
        codes = np.asarray(gptq_codes(w.astype(np.float64), h, steps, 0.01, grid=scheme.gptq_grid()))
    got = FP4_LEVELS.astype(np.float64)[codes.astype(int)]
    assert np.mean(got == expected) > 0.999
    assert np.mean(np.abs(got) != np.abs(np.asarray(FP4_LEVELS[np.asarray(q.qvalue, int)]))) > 0.05  # not RTN's


def test_the_grid_rounds_as_compressed_tensors_on_every_tie():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -7.0, -0.1, 0.0, -0.0], np.float32)
    codes, values = scheme_named("nvfp4a16").gptq_grid().round(jax.numpy.asarray(x))
    np.testing.assert_array_equal(np.asarray(values), [0, 1, 1, 2, 2, 4, 4, 0, -4, 6, -6, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(codes), [0, 2, 2, 4, 4, 6, 6, 8, 14, 7, 15, 8, 0, 0])


@pytest.mark.parametrize("name,preset", PRESETS)
def test_a_folder_has_the_presets_config_passes_verify_and_loads_in_transformers(tmp_path, capsys, name, preset):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch

    source = family_source(tmp_path, "llama")
    out = tmp_path / name
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", preset, "-q", *CALIB], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    group = parsed.config_groups["group_0"]
    want = preset_name_to_scheme(preset, ["Linear"])
    assert group.weights.model_copy(update={"observer": None}) == want.weights.model_copy(update={"observer": None})
    assert group.input_activations is None and parsed.format == scheme_named(name).layout.format
    folder = open_quantized(out)
    assert folder.scheme == name and folder.quantized_modules
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    assert json.loads(report)["passed"]
    ids, mask = token_batch(load_config(source)["vocab_size"])
    # compressed-tensors decompresses FP4 weights to bf16 whatever the model's dtype: both models run in bf16,
    # where qconvert's dequantized weight rounds to the decompressor's bytes (the read-back test above).
    loaded = bf16_logits(out, ids, mask)  # transformers + compressed-tensors reading the folder
    meant = bf16_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask)
    valid = mask.astype(bool)
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-3 * np.abs(meant[valid]).max()
    assert cosine(loaded, reference_logits(source, ids, mask), mask) >= 0.95
    # The float dtype FP4 tensors stand for is the model's (config.json's), which inspect shows and verify runs in;
    # a config naming no float dtype is one line, not an internal error.
    code, shown, err = run_cli(["inspect", str(out), "--json"], capsys)
    assert code == 0, err
    rows = [t for t in json.loads(shown)["tensors"] if t["kind"] == name]
    declared = load_config(source)
    assert rows and {t["float_dtype"] for t in rows} == {declared.get("torch_dtype", declared.get("dtype"))}
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "int8"}))
    code, _, err = run_cli(["inspect", str(out)], capsys)
    assert code == 6 and len(err.strip().splitlines()) == 1 and "torch_dtype is 'int8'" in err, err


def bf16_logits(folder, ids, mask) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(ids), dtype=torch.long),
                     attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    from hf_checkpoints import make_fp4_moe_checkpoint

    return make_fp4_moe_checkpoint(tmp_path_factory.mktemp("moe") / "src")


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_a_mixture_of_experts_passes_verify_and_transformers_reads_mxfp4s_experts_only(moe_source, tmp_path, capsys,
                                                                                        name):
    from hf_checkpoints import dequantized_float_folder, load_config, token_batch

    out = tmp_path / name
    code, _, err = run_cli(["quantize", str(moe_source), "-o", str(out), "--scheme", name, "-q", *CALIB], capsys)
    assert code == 0, err
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    record = json.loads(report)
    # The experts through the grouped matmul agree with the folder's own dequantized weights.
    assert min(layer["fidelity_sqnr_db"] for layer in record["layers"]) >= 40
    ids, mask = token_batch(load_config(moe_source)["vocab_size"])
    loaded = bf16_logits(out, ids, mask)
    meant = bf16_logits(dequantized_float_folder(moe_source, out, tmp_path / "meant"), ids, mask)
    valid = mask.astype(bool)
    error = np.abs(loaded[valid] - meant[valid]).max() / np.abs(meant[valid]).max()
    # transformers 5.24 decompresses fused NVFP4 experts without dividing by their global scale (servers.py: no).
    assert error <= 1e-3 if name == "mxfp4a16" else error > 0.1


def test_a_width_the_group_does_not_divide_is_a_usage_error(tmp_path, capsys):
    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=88)
    code, _, err = run_cli(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "mxfp4a16"], capsys)
    assert code == 2
    assert "multiples of 32" in err and "down_proj's is 88" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_the_reference_matmul_equals_float64_at_real_k(name):
    from qconvert.kernels.reference import fp4_weight_matmul_reference

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((384, 4096)) * 0.02).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((8, 4096)).astype(np.float32)
    q = scheme_named(name).quantize(w, LayoutFlags(), scale_dtype=None)
    # float64 from the format's definition: E2M1 value times (scale / global scale), the quotient in float32.
    magnitudes = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    codes = np.asarray(q.qvalue).astype(int)
    values = np.where(codes & 8, -1.0, 1.0) * magnitudes[codes & 7]
    scale = np.asarray(q.scale, np.float32)
    if q.zero_point is not None:
        scale = scale / np.float32(np.asarray(q.zero_point).reshape(()))
    weight = values * np.repeat(scale.astype(np.float64), q.block_size, axis=1)
    expected = x.astype(np.float64) @ weight.T
    got = np.asarray(fp4_weight_matmul_reference(x, q.qvalue, q.scale, group_size=q.block_size, w_global=q.zero_point))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    # Through qlinear, as verify runs a folder's linear.
    from qconvert.kernels import qlinear

    np.testing.assert_allclose(np.asarray(qlinear(x, q, out_dtype=np.float32)), got, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nvfp4a16", "mxfp4a16"])
def test_the_clip_search_never_does_worse_than_the_plain_scale(name):
    rng = np.random.default_rng(4)
    w = (rng.standard_t(3, size=(32, 256)) * 0.02).astype(np.float32)  # heavy tails: clipping pays somewhere
    scheme = scheme_named(name)
    found = scheme.clip_search(w, LayoutFlags())
    assert found.ratios.shape == (32, 256 // scheme.group) and (found.ratios < 1).any()
    assert found.error_searched < found.error_plain

    def error(ratios):
        q = scheme.quantize(w, LayoutFlags(), scale_dtype=None, clip=ratios)
        return float(np.sum((dequantize_fp4(q).astype(np.float64) - w) ** 2))

    assert error(found.ratios) == pytest.approx(found.error_searched, rel=1e-6)
    assert error(found.ratios) < error(None)


def test_fused_shards_share_one_global_scale_as_llm_compressors_fused_observers_give_it(tmp_path, capsys):
    """q/k/v and gate/up: one global scale from their joint absmax (vLLM applies one per fused layer), each shard's
    bytes compressed-tensors' own with that global scale; o_proj and down_proj keep their own."""
    import torch
    from compressed_tensors.quantization.utils import generate_gparam

    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=128, layers=1, dtype="bfloat16")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nvfp4a16", "--no-gptq", "-q"],
                           capsys)
    assert code == 0, err
    from safetensors.torch import load_file

    weights = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in
               load_file(str(source / "model.safetensors")).items()}
    folder = {}
    for shard in out.glob("*.safetensors"):
        folder.update(load_file(str(shard)))
    prefix = "model.layers.0."
    for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj",), ("mlp.down_proj",)):
        joint = max(float(np.abs(weights[f"{prefix}{m}.weight"].astype(np.float32)).max()) for m in fused)
        gparam = generate_gparam(torch.tensor([-joint], dtype=torch.bfloat16), torch.tensor([joint], dtype=torch.bfloat16))
        for m in fused:
            assert folder[f"{prefix}{m}.weight_global_scale"].item() == gparam.item(), m
            theirs = compressed_tensors_fp4(weights[f"{prefix}{m}.weight"], "NVFP4A16", global_scale=gparam)
            for key, value in theirs.items():
                got = folder[f"{prefix}{m}.{key}"]
                got = got.view(torch.uint8).numpy() if got.dtype == torch.float8_e4m3fn else got.numpy()
                assert got.tobytes() == value.tobytes(), (m, key)


def test_gptq_rounds_fused_shards_on_their_one_global_scale(tmp_path, capsys):
    """nvfp4a16 with --gptq: q/k/v and gate/up each carry the global scale compressed-tensors' generate_gparam
    gives their joint absmax (the weights GPTQ rounds are the source's: --no-awq, no smoothing)."""
    import torch
    from compressed_tensors.quantization.utils import generate_gparam
    from safetensors.torch import load_file

    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=128, layers=1, dtype="bfloat16")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nvfp4a16", "--gptq", "--no-awq",
                            "--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16", "-q"], capsys)
    assert code == 0, err
    weights = load_file(str(source / "model.safetensors"))
    folder = {k: v for shard in out.glob("*.safetensors") for k, v in load_file(str(shard)).items()}
    prefix = "model.layers.0."
    for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        joint = max(float(weights[f"{prefix}{m}.weight"].float().abs().max()) for m in fused)
        gparam = generate_gparam(torch.tensor([-joint], dtype=torch.bfloat16), torch.tensor([joint], dtype=torch.bfloat16))
        assert [folder[f"{prefix}{m}.weight_global_scale"].item() for m in fused] == [gparam.item()] * len(fused)


def test_a_folder_whose_scale_is_not_a_number_is_refused_naming_it():
    from qconvert.formats.errors import FormatError

    w = awkward_weight(ml_dtypes.bfloat16, rows=16, cols=64)
    for name, preset, bad in (("mxfp4a16", "MXFP4A16", 255), ("nvfp4a16", "NVFP4A16", 0x7F)):
        tensors = {f"m.{k}": v.copy() for k, v in compressed_tensors_fp4(w, preset).items()}
        tensors["m.weight_scale"].view(np.uint8)[2, 1] = bad  # E8M0's NaN; E4M3's NaN
        with pytest.raises(FormatError, match="m weight_scale"):
            scheme_named(name).layout.read_qarray(_Source(tensors), "m")
