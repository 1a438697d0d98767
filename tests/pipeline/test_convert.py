"""The quantize pipeline on tiny Llama/BERT checkpoints and the real all-MiniLM-L6-v2, read back with safetensors."""

import errno
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from checkpoints import make_bert_checkpoint, make_llama_checkpoint, minilm_path
from quantize_reference import LEVELS, numpy_int8, numpy_nf4, unpack_int32_words
from hub_cache import COMMIT, build_hub_cache
import qconvert.convert as convert_module
import qconvert.write.output as output_module
import qconvert.write.tensors as tensors_module
from qconvert.convert import ConvertOptions, convert
from qconvert.formats.errors import InvalidWeightError, OutputWriteError, UsageError
from qconvert.formats.layouts import open_quantized
from qconvert.inspection import inspect_checkpoint

LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def read_folder(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of every shard, read with the safetensors library itself."""
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def leftovers(parent: Path) -> list[str]:
    """Hidden staging folders left beside the output."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama") / "src", shards=3, dtype="bfloat16")


def test_int8_sharded_bf16_llama_codes_and_scales_equal_numpy(llama_bf16, tmp_path):
    out = tmp_path / "out"
    result = convert(str(llama_bf16), out, ConvertOptions(scheme="int8", max_shard_size=40_000))
    src, dst = read_folder(llama_bf16), read_folder(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(dst)
    for i in range(2):
        for linear in LLAMA_LINEARS:
            m = f"model.layers.{i}.{linear}"
            q_ref, scale_ref = numpy_int8(src[f"{m}.weight"], ml_dtypes.bfloat16)
            cols = src[f"{m}.weight"].shape[1]
            np.testing.assert_array_equal(unpack_int32_words(dst[f"{m}.weight_packed"], cols), q_ref)
            assert dst[f"{m}.weight_scale"].dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(dst[f"{m}.weight_scale"], scale_ref)
            np.testing.assert_array_equal(dst[f"{m}.weight_shape"], src[f"{m}.weight"].shape)
            assert f"{m}.weight" not in dst
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.input_layernorm.weight"):
        np.testing.assert_array_equal(dst[name], src[name])
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    assert (out / "generation_config.json").read_bytes() == (llama_bf16 / "generation_config.json").read_bytes()
    assert len(result.quantized_modules) == 14


def test_nf4_bert_bytes_and_absmax_equal_the_formats_rules(tmp_path):
    src_folder = make_bert_checkpoint(tmp_path / "src", shards=2, hidden=48, intermediate=80)
    out = tmp_path / "out"
    convert(str(src_folder), out, ConvertOptions(scheme="nf4"))
    src, dst = read_folder(src_folder), read_folder(out)
    for i in range(2):
        for linear in ("attention.self.query", "attention.output.dense", "intermediate.dense", "output.dense"):
            m = f"encoder.layer.{i}.{linear}"
            w = src[f"{m}.weight"]
            packed_ref, absmax_ref = numpy_nf4(w)
            np.testing.assert_array_equal(dst[f"{m}.weight"].reshape(-1), packed_ref)
            np.testing.assert_array_equal(dst[f"{m}.weight.absmax"], absmax_ref)
            np.testing.assert_array_equal(dst[f"{m}.weight.quant_map"], LEVELS)
            state = json.loads(dst[f"{m}.weight.quant_state.bitsandbytes__nf4"].tobytes())
            assert state == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(w.shape)}
            np.testing.assert_array_equal(dst[f"{m}.bias"], src[f"{m}.bias"])
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["bnb_4bit_quant_type"] == "nf4" and qc["llm_int8_skip_modules"] == ["lm_head"]


def test_nf4_double_quant_absmax_decodes_within_the_map_resolution(llama_bf16, tmp_path):
    out = tmp_path / "out"
    convert(str(llama_bf16), out, ConvertOptions(scheme="nf4", double_quant=True))
    src, dst = read_folder(llama_bf16), read_folder(out)
    m = "model.layers.1.mlp.down_proj"
    _, absmax = numpy_nf4(src[f"{m}.weight"])
    state = json.loads(dst[f"{m}.weight.quant_state.bitsandbytes__nf4"].tobytes())
    codes, nested = dst[f"{m}.weight.absmax"], dst[f"{m}.weight.nested_absmax"]
    dyn_map = dst[f"{m}.weight.nested_quant_map"]
    assert codes.dtype == np.uint8 and state["nested_blocksize"] == 256
    np.testing.assert_allclose(state["nested_offset"], absmax.astype(np.float64).mean(), rtol=1e-6)
    decoded = dyn_map[codes] * nested[np.arange(codes.size) // 256] + np.float32(state["nested_offset"])
    # The dynamic map's gaps are under 5% of the block's absmax deviation around the ends of its range.
    assert np.max(np.abs(decoded - absmax)) <= 0.05 * np.max(np.abs(absmax - state["nested_offset"])) + 1e-7


def test_tied_embeddings_write_no_lm_head(tmp_path):
    src_folder = make_llama_checkpoint(tmp_path / "src", tie=False)
    config = json.loads((src_folder / "config.json").read_text())
    config["tie_word_embeddings"] = True  # a tied model that also stored its lm_head copy
    (src_folder / "config.json").write_text(json.dumps(config))
    convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="int8"))
    dst = read_folder(tmp_path / "out")
    assert "lm_head.weight" not in dst and "model.embed_tokens.weight" in dst
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    with pytest.raises(UsageError, match="tied"):
        convert(str(src_folder), tmp_path / "out2", ConvertOptions(scheme="int8", include=("lm_head",)))


def test_tied_checkpoint_without_lm_head_stays_without(tmp_path):
    src_folder = make_llama_checkpoint(tmp_path / "src", tie=True)
    convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="nf4"))
    assert not any(k.startswith("lm_head") for k in read_folder(tmp_path / "out"))


def test_two_runs_give_identical_bytes(llama_bf16, tmp_path):
    for name in ("a", "b"):
        convert(str(llama_bf16), tmp_path / name, ConvertOptions(scheme="nf4", double_quant=True,
                                                                 max_shard_size=30_000))
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*"))
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*"))
    assert files_a == files_b and len(files_a) > 4
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_qconvert_json_records_source_flags_and_output_hashes(llama_bf16, tmp_path):
    import hashlib

    out = tmp_path / "out"
    convert(str(llama_bf16), out, ConvertOptions(scheme="int8", exclude=("re:.*mlp.*",)))
    manifest = json.loads((out / "qconvert.json").read_text())
    assert manifest["scheme"] == "int8" and manifest["flags"]["exclude"] == ["re:.*mlp.*"]
    assert manifest["calibration"] is None and manifest["smoothing"] is None
    for name, digest in manifest["source"]["files"].items():
        assert hashlib.sha256((llama_bf16 / name).read_bytes()).hexdigest() == digest
    written = sorted(p.name for p in out.iterdir() if p.name != "qconvert.json")
    assert sorted(manifest["files"]) == written
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore[0] == "lm_head" and "model.layers.0.mlp.down_proj" in ignore
    assert "model.layers.0.mlp.down_proj.weight" in read_folder(out)


def test_include_quantizes_lm_head(tmp_path):
    src_folder = make_llama_checkpoint(tmp_path / "src")
    convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="int8", include=("lm_head",)))
    dst = read_folder(tmp_path / "out")
    assert "lm_head.weight_packed" in dst and "lm_head.weight" not in dst
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"] == []


def test_pattern_matching_nothing_is_a_usage_error(tmp_path):
    src_folder = make_llama_checkpoint(tmp_path / "src")
    with pytest.raises(UsageError, match="--exclude nothing"):
        convert(str(src_folder), tmp_path / "out", ConvertOptions(exclude=("nothing",)))
    assert not (tmp_path / "out").exists()


def test_dry_run_writes_nothing_and_predicts_the_size(llama_bf16, tmp_path):
    planned = convert(str(llama_bf16), tmp_path / "out", ConvertOptions(scheme="nf4", dry_run=True))
    assert not (tmp_path / "out").exists() and planned.out is None
    real = convert(str(llama_bf16), tmp_path / "out", ConvertOptions(scheme="nf4"))
    data_bytes = sum(a.nbytes for a in read_folder(tmp_path / "out").values())
    assert planned.output_bytes == real.output_bytes == data_bytes
    assert {t.kind for t in planned.tensors} == {"nf4", "unchanged"}


def test_minilm_round_trips_within_each_scheme_bound(tmp_path):
    source = minilm_path()
    src = read_folder(source)
    for scheme in ("int8", "nf4"):
        out = tmp_path / scheme
        convert(str(source), out, ConvertOptions(scheme=scheme))
        assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
        qc = open_quantized(out)
        assert len(qc.quantized_modules) == 36  # 6 layers x 6 linears; pooler.dense stays float
        for m in qc.quantized_modules:
            w = src[f"{m}.weight"].astype(np.float32)
            q = qc.qarray(m)
            deq = np.asarray(q.dequantize(np.float32))
            if scheme == "int8":
                q_ref, scale_ref = numpy_int8(w, np.float32)
                np.testing.assert_array_equal(np.asarray(q.qvalue), q_ref)
                assert np.all(np.abs(deq - w) <= scale_ref / 2 * (1 + 1e-5))
            else:
                absmax = np.repeat(numpy_nf4(w)[1], 64)[: w.size].reshape(w.shape)
                assert np.all(np.abs(deq - w) <= absmax * np.max(np.diff(LEVELS)) / 2 * (1 + 1e-5))
        assert "pooler.dense.weight" in qc.float_names
        # int64 position_ids pass through as they are: inspect calls them unchanged, not float.
        report = inspect_checkpoint(out)
        kinds = {t["name"]: (t["kind"], t["dtype"], t["float_dtype"]) for t in report.summary()["tensors"]}
        assert kinds["embeddings.position_ids"] == ("unchanged", "int64", "int64")
        assert kinds["pooler.dense.weight"] == ("unchanged", "float32", "float32")
        # A quantized linear is stored as its codes, packed (README: int8 four to an int32 word, nf4 two to a
        # byte), and stands for float32.
        codes = {"int8": "int8 in int32", "nf4": "nf4 in uint8"}[scheme]
        assert kinds["encoder.layer.0.attention.self.query"] == (scheme, codes, "float32")
        assert {t.kind for t in report.tensors} == {scheme, "unchanged"}
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]
        assert "pooler.dense" in (ignore.get("ignore") or ignore.get("llm_int8_skip_modules"))


def test_hub_id_quantizes_offline_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = make_llama_checkpoint(tmp_path / "src", shards=2)
    (source / "tokenizer.json").write_text('{"version": "1.0"}')
    build_hub_cache(tmp_path / "hf", "org/tiny-llama", source)
    result = convert("org/tiny-llama", tmp_path / "out", ConvertOptions(scheme="int8"))
    manifest = json.loads((tmp_path / "out" / "qconvert.json").read_text())
    assert manifest["source"]["model"] == "org/tiny-llama" and manifest["source"]["is_hub"] is True
    assert manifest["source"]["commit"] == COMMIT and result.source["commit"] == COMMIT
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"version": "1.0"}'


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_in_a_weight_is_refused_and_leaves_nothing(tmp_path, name, bad):
    src_folder = make_llama_checkpoint(tmp_path / "src")
    tensors = load_file(str(src_folder / "model.safetensors"))
    tensors[name].reshape(-1)[3] = bad
    save_file(tensors, str(src_folder / "model.safetensors"))
    with pytest.raises(InvalidWeightError, match=name.replace(".", r"\.")):
        convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="int8"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("shape", [(64,), (2, 32, 64), (0, 64)])
def test_a_linear_weight_the_scheme_cannot_take_is_refused(tmp_path, shape):
    src_folder = make_llama_checkpoint(tmp_path / "src")
    tensors = load_file(str(src_folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros(shape, np.float32)
    save_file(tensors, str(src_folder / "model.safetensors"))
    with pytest.raises(InvalidWeightError, match="q_proj"):
        convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="nf4"))
    assert not (tmp_path / "out").exists()


def test_full_disk_leaves_no_output_and_no_temp_folder(llama_bf16, tmp_path, monkeypatch):
    real_write = output_module.write_shards

    def write_until_full(folder, specs, tensors, max_shard_size, metadata=None):
        def some_then_full():
            for k, item in enumerate(tensors):
                if k == 5:
                    raise OSError(errno.ENOSPC, "No space left on device")
                yield item
        return real_write(folder, specs, some_then_full(), max_shard_size, metadata)

    monkeypatch.setattr(output_module, "write_shards", write_until_full)
    with pytest.raises(OutputWriteError, match="No space left"):
        convert(str(llama_bf16), tmp_path / "out", ConvertOptions(scheme="int8"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def interrupt_at_tensor(monkeypatch, count: int) -> None:
    """Ctrl-C while the `count`-th tensor is read (on a worker thread, as a real one would arrive)."""
    real, seen = tensors_module.output_tensors, []

    def interrupted(ckpt, planned, *args, **kwargs):
        seen.append(planned.source)
        if len(seen) == count:
            raise KeyboardInterrupt
        return real(ckpt, planned, *args, **kwargs)

    monkeypatch.setattr(tensors_module, "output_tensors", interrupted)


def test_ctrl_c_leaves_no_output_and_no_temp_folder(llama_bf16, tmp_path, monkeypatch):
    interrupt_at_tensor(monkeypatch, 4)
    with pytest.raises(KeyboardInterrupt):
        convert(str(llama_bf16), tmp_path / "out", ConvertOptions(scheme="nf4"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_overwrite_replaces_and_a_failed_overwrite_keeps_the_old_output(llama_bf16, tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert(str(llama_bf16), out, ConvertOptions(scheme="nf4"))
    convert(str(llama_bf16), out, ConvertOptions(scheme="int8", overwrite=True))
    assert json.loads((out / "qconvert.json").read_text())["scheme"] == "int8"

    interrupt_at_tensor(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        convert(str(llama_bf16), out, ConvertOptions(scheme="nf4", overwrite=True))
    assert json.loads((out / "qconvert.json").read_text())["scheme"] == "int8" and leftovers(tmp_path) == []


def test_weight_transform_and_static_input_scales_reach_the_w8a8_folder(tmp_path, monkeypatch):
    from qconvert.formats.record import SmoothingRecord
    from qconvert.methods.fold import TensorFold
    from qconvert.methods.recipe import Adjustments

    src_folder = make_llama_checkpoint(tmp_path / "src", layers=1)
    src = read_folder(src_folder)
    norm = "model.layers.0.input_layernorm.weight"
    modules = [f"model.layers.0.{x}" for x in LLAMA_LINEARS]
    scales = {m: 0.01 * (k + 1) for k, m in enumerate(modules)}
    record = SmoothingRecord("given", 0.5, 1e-5, "", {norm[:-7]: 0.5}, {norm[:-7]: ("x",)}, {})
    # The w8a8 stage's result, given: the norm's rows divided by 1/2 (doubled), nothing else touched.
    halves = np.full(src[norm].shape[0], 0.5, np.float32)
    given = Adjustments(folds={norm: TensorFold(halves, None)}, input_scales=scales, smoothing_record=record)
    monkeypatch.setattr(convert_module, "prepare_adjustments",
                        lambda source, options, steps=None, message=None, gptq=None: given)
    convert(str(src_folder), tmp_path / "out", ConvertOptions(scheme="w8a8", act="static", scale_search=False,
                                                              gptq=False))
    dst = read_folder(tmp_path / "out")
    np.testing.assert_array_equal(dst[norm], src[norm] * 2)
    for m in modules:
        np.testing.assert_array_equal(dst[f"{m}.weight"], numpy_int8(src[f"{m}.weight"], np.float32)[0])
        np.testing.assert_array_equal(dst[f"{m}.input_scale"], np.array([scales[m]], np.float32))
    assert json.loads((tmp_path / "out" / "qconvert.json").read_text())["smoothing"] == {
        "method": "smoothquant", "alpha_mode": "given", "family_default_alpha": 0.5, "min_scale": 1e-5, "remedy": "",
        "alpha": {norm[:-7]: 0.5}, "groups": {norm[:-7]: ["x"]}}


def test_inspect_reports_sizes_and_notices_a_changed_file(llama_bf16, tmp_path):
    out = tmp_path / "out"
    result = convert(str(llama_bf16), out, ConvertOptions(scheme="int8"))
    report = inspect_checkpoint(out)
    assert report.scheme == "int8" and report.hashes_ok is True
    assert report.stored_bytes == result.output_bytes
    assert report.float_bytes == result.input_bytes  # every tensor kept or stood for, at bf16
    row = {t.name: t for t in report.tensors}["model.layers.0.mlp.up_proj"]
    assert row.shape == (128, 64) and row.kind == "int8" and (row.dtype, row.float_dtype) == ("int8 in int32", "bfloat16")
    with open(out / "generation_config.json", "a") as f:
        f.write(" ")
    bad = inspect_checkpoint(out)
    assert bad.hashes_ok is False and [f.name for f in bad.files if not f.ok] == ["generation_config.json"]
