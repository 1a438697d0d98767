"""quantize --awq end to end: a tiny Llama and a tiny Qwen3-MoE convert in int4 (rounded to nearest and by GPTQ)
and nf4, pass verify, load in transformers (+ compressed-tensors) near the float logits; the recorded scales
folded into the float model leave its function unchanged; verify fails on an edited scale; and --awq refuses
what it cannot apply to in one line."""

from __future__ import annotations

import base64
import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import qconvert
from cli_helpers import run as run_cli
from hf_checkpoints import load_config, make_hf_checkpoint, reference_logits, token_batch
from qconvert.models import build

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"]
NORM = "model.layers.0.input_layernorm"


def quantize(source, out, capsys, *flags):
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "-q", "--awq", *CALIB, *flags], capsys)
    assert code == 0, err
    return json.loads((out / "qconvert.json").read_text())


def verify(folder, capsys):
    code, out, err = run_cli(["verify", str(folder), "--quick", "--backend", "xla", "--json", "-"], capsys)
    return code, (json.loads(out) if out.strip() else None), err


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def recorded_scales(record, source, key="source_scales"):
    entry = record["smoothing"]["scales"][source]
    return np.frombuffer(base64.b64decode(entry.get(key, entry["source_scales"])), "<f4")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama") / "src", "llama", layers=1, peaked=True)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    # Expert widths of 32, so int4 groups of 32 divide every input.
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "src", "qwen3_moe", layers=1, peaked=True,
                              intermediate=64, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def llama_int4(llama, tmp_path_factory):
    """int4 rounded to nearest after AWQ (group 32: the tiny widths are 64 and 96)."""
    out = tmp_path_factory.mktemp("llama_int4") / "out"
    code, _, err = _quantize_uncaptured(llama, out, "--scheme", "int4", "--group-size", "32", "--no-gptq")
    assert code == 0, err
    return out


def _quantize_uncaptured(source, out, *flags):
    from qconvert.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["quantize", str(source), "-o", str(out), "-q", "--awq", *CALIB, *flags])
    return done.value.code, "", ""


def loads_near_float_in_transformers(source, out, min_cosine: float) -> None:
    """transformers (compressed-tensors for int4) reads `out` as qconvert's own forward of it does, and both are
    near the float model's logits."""
    config = load_config(source)
    ids, mask = token_batch(config["vocab_size"])
    valid = mask.astype(bool)
    loaded = reference_logits(out, ids, mask)
    model = build(qconvert.load_config(out))
    ours = np.asarray(jax.jit(model.forward)(qconvert.flatten_params(qconvert.load(out)), ids, mask))
    assert np.abs(loaded[valid] - ours[valid]).max() <= 1e-3 * np.abs(ours[valid]).max()
    assert cosine(loaded[valid], reference_logits(source, ids, mask)[valid]) >= min_cosine


def test_llama_int4_awq_records_real_scales_passes_verify_and_loads_in_transformers(llama, llama_int4, capsys):
    record = json.loads((llama_int4 / "qconvert.json").read_text())
    smoothing = record["smoothing"]
    assert smoothing["method"] == "awq" and record["rounding"] == {"method": "rtn"}
    # input norm -> q/k/v, v -> o, post-attention norm -> gate/up, up -> down; 40 candidates each.
    assert sorted(smoothing["groups"]) == sorted(["model.layers.0.input_layernorm", "model.layers.0.self_attn.v_proj",
                                                  "model.layers.0.post_attention_layernorm",
                                                  "model.layers.0.mlp.up_proj"])
    assert all(len(tried) == 40 for tried in smoothing["alpha_search"].values())
    assert any(np.abs(recorded_scales(record, s) - 1).max() > 1e-3 for s in smoothing["groups"])
    assert "| rounding | AWQ's per-channel scales (searched on the calibration text below" in \
        (llama_int4 / "README.md").read_text()  # the model card says so
    code, report, err = verify(llama_int4, capsys)
    assert code == 0 and report["passed"], err
    loads_near_float_in_transformers(llama, llama_int4, 0.98)


def test_the_recorded_scales_folded_into_the_float_model_keep_its_function(llama, llama_int4, tmp_path):
    from qconvert.methods.fold import GroupScales, apply_fold, tensor_folds
    from qconvert.models.family import SmoothingGroup

    record = json.loads((llama_int4 / "qconvert.json").read_text())
    smoothing = record["smoothing"]
    folds = tensor_folds([GroupScales(SmoothingGroup(source, tuple(smoothing["groups"][source])), 0.0,
                                      recorded_scales(record, source), recorded_scales(record, source, "input_scales"))
                          for source in smoothing["groups"]])
    tensors = load_file(str(llama / "model.safetensors"))
    folded = {name: apply_fold(t, folds[name]) if name in folds else t for name, t in tensors.items()}
    assert not np.array_equal(folded[f"{NORM}.weight"], tensors[f"{NORM}.weight"])
    (tmp_path / "folded").mkdir()
    shutil.copy(llama / "config.json", tmp_path / "folded" / "config.json")
    save_file(folded, str(tmp_path / "folded" / "model.safetensors"))
    ids, mask = token_batch(load_config(llama)["vocab_size"])
    want, got = reference_logits(llama, ids, mask), reference_logits(tmp_path / "folded", ids, mask)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_verify_fails_in_one_line_when_a_recorded_awq_scale_is_edited(llama_int4, tmp_path, capsys):
    copy = shutil.copytree(llama_int4, llama_int4.parent / f"edited-{tmp_path.name}")
    record = json.loads((copy / "qconvert.json").read_text())
    s = recorded_scales(record, NORM).copy()
    s[3] *= 1.5
    record["smoothing"]["scales"][NORM]["source_scales"] = base64.b64encode(s.astype("<f4").tobytes()).decode()
    (copy / "qconvert.json").write_text(json.dumps(record))
    code, report, _ = verify(copy, capsys)
    assert code == 1 and not report["passed"]
    assert (f"{NORM}.weight: 1 of 64 values are not the reference's with the smoothing scales qconvert.json "
            "records folded in") in report["integrity"]["problems"]


def test_llama_int4_awq_then_gptq_loads_in_transformers(llama, tmp_path, capsys):
    record = quantize(llama, tmp_path / "gptq", capsys, "--scheme", "int4", "--group-size", "32")
    assert record["smoothing"]["method"] == "awq" and record["rounding"]["method"] == "gptq"
    loads_near_float_in_transformers(llama, tmp_path / "gptq", 0.98)


def test_llama_nf4_awq_loads_back_near_the_float_model(llama, tmp_path, capsys):
    out = tmp_path / "nf4"
    record = quantize(llama, out, capsys, "--scheme", "nf4")
    assert record["smoothing"]["method"] == "awq"
    config = load_config(llama)
    ids, mask = token_batch(config["vocab_size"])
    valid = mask.astype(bool)
    logits = np.asarray(jax.jit(build(qconvert.load_config(out)).forward)(
        qconvert.flatten_params(qconvert.load(out)), ids, mask))
    assert cosine(logits[valid], reference_logits(llama, ids, mask)[valid]) >= 0.98


def test_qwen3_moe_int4_awq_and_gptq_scales_every_expert_passes_verify_and_loads(qwen3_moe, tmp_path, capsys):
    out = tmp_path / "int4"
    record = quantize(qwen3_moe, out, capsys, "--scheme", "int4", "--group-size", "32")
    groups = record["smoothing"]["groups"]
    # The post-attention norm feeds every expert's gate/up (and the float router), each expert's up its down.
    norm = groups["model.layers.0.post_attention_layernorm"]
    assert {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj")} <= set(norm)
    assert "model.layers.0.mlp.gate" in norm
    assert {f"model.layers.0.mlp.experts.{e}.up_proj" for e in range(4)} <= set(groups)
    code, report, err = verify(out, capsys)
    assert code == 0 and report["passed"], err
    loads_near_float_in_transformers(qwen3_moe, out, 0.98)


@pytest.mark.parametrize("flags, message", [
    (["--scheme", "w8a8"], "--awq applies to --scheme"),
    (["--scheme", "int4", "--act-stats", "stats.safetensors"], "--act-stats apply to --scheme w8a8"),
])
def test_awq_refuses_what_it_cannot_apply_to_in_one_line(llama, tmp_path, capsys, flags, message):
    code, _, err = run_cli(["quantize", str(llama), "-o", str(tmp_path / "out"), "--awq", *flags], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_help_documents_awq(capsys):
    code, out, _ = run_cli(["quantize", "--help"], capsys)
    assert code == 0 and "--awq / --no-awq" in out


def test_awq_then_gptq_is_the_4_bit_integer_schemes_default(llama, tmp_path, capsys):
    """int4, int4-asym and w4a8-fp8 search AWQ's scales unasked, then GPTQ rounds; --no-awq does not."""
    methods = {}
    for name, flags in (("int4", ["--scheme", "int4"]), ("int4-asym", ["--scheme", "W4A16_ASYM"]),
                        ("no-awq", ["--scheme", "int4", "--no-awq"]), ("w4a8", ["--scheme", "w4a8-fp8"])):
        out = tmp_path / name
        code, _, err = run_cli(["quantize", str(llama), "-o", str(out), "--group-size", "32", *CALIB, "-q", *flags],
                               capsys)
        assert code == 0, err
        record = json.loads((out / "qconvert.json").read_text())
        methods[name] = ((record.get("smoothing") or {}).get("method"), record["rounding"]["method"])
    assert methods == {"int4": ("awq", "gptq"), "int4-asym": ("awq", "gptq"), "no-awq": (None, "gptq"),
                       "w4a8": ("awq", "gptq")}


def test_awq_on_a_decoder_without_a_forward_is_refused_in_one_line(tmp_path, capsys):
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, vocab_size=96, max_position_embeddings=64)
    config.architectures = ["GPTNeoXForCausalLM"]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "neox"))
    capsys.readouterr()  # transformers' own progress
    code, _, err = run_cli(["quantize", str(tmp_path / "neox"), "-o", str(tmp_path / "out"), "--scheme", "int4",
                            "--any-architecture", "--awq", "-q"], capsys)
    assert code == 2 and err.strip().splitlines() == [
        "qconvert: error: --awq needs the model's forward pass for calibration, which --any-architecture does not "
        "have for this model; drop --awq"], err
    assert not (tmp_path / "out").exists()
    # int4's default AWQ (and GPTQ) give way to round-to-nearest there, as asked of no flag
    code, _, err = run_cli(["quantize", str(tmp_path / "neox"), "-o", str(tmp_path / "out"), "--scheme", "int4",
                            "--any-architecture", "-q"], capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    assert record.get("smoothing") is None and record["rounding"]["method"] == "rtn"
