"""qconvert verify can fail: corrupted scales, flipped bytes, dropped tensors, edited shards, bad input,
and layers that fell back from the Pallas kernel; each with its message and exit code."""

import hashlib
import json
import shutil

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from safetensors.numpy import load_file, save_file

from cli_helpers import run as run_cli
from qconvert.cli.main import main

TINY = dict(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=128)
LAYER = "model.layers.0.mlp.up_proj"


def verify(folder, capsys, *extra):
    code, out, err = run_cli(["verify", str(folder), "--quick", "--backend", "cpu", "--json", "-", *extra], capsys)
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Llama and its int8 conversion cut into several shards."""
    root = tmp_path_factory.mktemp("fail")
    source = make_llama_checkpoint(root / "src", **TINY)
    out = root / "int8"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(source), "-o", str(out), "--scheme", "int8", "--max-shard-size", "20KB", "--quiet"])
    assert exc.value.code == 0
    return out


@pytest.fixture
def copy(converted, tmp_path):
    """A copy beside the conversion: qconvert.json finds its source from OUT ("../src"), as from the original."""
    target = converted.parent / f"copy-{tmp_path.name}"
    shutil.copytree(converted, target)
    yield target
    shutil.rmtree(target, ignore_errors=True)


def shard_of(folder, tensor):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]


def rewrite_shard(path, change):
    """Load a shard, let `change` edit the dict of tensors, save it back (a valid safetensors file)."""
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def rehash(folder):
    """Record the current sha256 of every file, as a buggy converter would have written it."""
    record = json.loads((folder / "qconvert.json").read_text())
    for name in record["files"]:
        record["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "qconvert.json").write_text(json.dumps(record))


def test_the_unchanged_sharded_conversion_passes(converted, capsys):
    assert len(list(converted.glob("model-*.safetensors"))) > 1
    code, record, err = verify(converted, capsys)
    assert code == 0, err
    assert record["passed"] and record["fidelity_passed"] and record["quality_passed"]
    for layer in record["layers"]:
        # int8 codes times a float32 scale: the kernel and the folder's arithmetic agree to rounding
        assert layer["fidelity_sqnr_db"] == "inf" or layer["fidelity_sqnr_db"] > 100, layer
        assert layer["fidelity_passed"] and layer["quality_passed"]
    assert "kernels match the folder" in record["verdict"]


def test_a_scale_off_by_two_fails_that_layer(copy, capsys):
    def double(t):
        t[f"{LAYER}.weight_scale"] = t[f"{LAYER}.weight_scale"] * 2
    rewrite_shard(shard_of(copy, f"{LAYER}.weight_scale"), double)
    rehash(copy)  # the hashes agree: only the numbers can tell
    code, record, err = verify(copy, capsys)
    assert code == 1
    assert record["integrity"]["passed"] and not record["passed"]
    bad = {r["name"]: r for r in record["layers"] if not r["passed"]}
    assert set(bad) == {LAYER}
    # Output doubled: the error is as large as the signal, SQNR 0 dB.
    assert bad[LAYER]["sqnr_db"] == pytest.approx(0.0, abs=0.1)
    assert record["verdict"].startswith(f"FAIL int8 {copy}: {LAYER}: sqnr_db")
    assert f"FAIL int8 {copy}: {LAYER}: sqnr_db" in err  # the one-line verdict in the log
    # The folder itself is wrong, not the kernel: the kernel computes exactly what the folder says.
    assert record["fidelity_passed"] and not record["quality_passed"]
    assert "quality: the kernels and the folder agree" in record["verdict"]
    # On a random tiny model one doubled MLP barely moves the near-uniform logits; the
    # per-layer check is what catches it.


def test_flipped_payload_bytes_fail_integrity_naming_the_file(copy, capsys):
    path = shard_of(copy, f"{LAYER}.weight_packed")
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    code, record, err = verify(copy, capsys)
    assert code == 1
    assert not record["integrity"]["passed"] and record["layers"] == []
    assert record["integrity"]["problems"] == [
        f"{path.name}: sha256 mismatch (recorded {json.loads((copy / 'qconvert.json').read_text())['files'][path.name][:12]}"
        f"..., found {hashlib.sha256(path.read_bytes()).hexdigest()[:12]}...); the file changed after conversion"]
    assert record["verdict"].startswith(f"FAIL int8 {copy}: integrity: {path.name}: sha256 mismatch")


def test_a_dropped_tensor_fails_naming_tensor_and_file(copy, capsys):
    path = shard_of(copy, f"{LAYER}.weight_scale")
    rewrite_shard(path, lambda t: t.pop(f"{LAYER}.weight_scale"))
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][f"{LAYER}.weight_scale"]
    index_path.write_text(json.dumps(index))
    rehash(copy)
    code, record, err = verify(copy, capsys)
    assert code == 1
    problems = record["integrity"]["problems"]
    assert any(f"tensor {LAYER}.weight_scale is missing" in p for p in problems), problems
    assert any(p.startswith(path.name) or path.name in p for p in problems), problems


def test_a_dropped_float_tensor_fails(copy, capsys):
    name = "model.layers.0.input_layernorm.weight"
    rewrite_shard(shard_of(copy, name), lambda t: t.pop(name))
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    rehash(copy)
    code, record, _ = verify(copy, capsys)
    assert code == 1
    assert any(f"tensor {name} is missing" in p for p in record["integrity"]["problems"])


def test_a_shard_edited_after_writing_fails_naming_it(copy, capsys):
    name = "model.norm.weight"
    path = shard_of(copy, name)

    def nudge(t):
        t[name] = (t[name] * np.float32(1.01)).astype(t[name].dtype)
    rewrite_shard(path, nudge)
    code, record, err = verify(copy, capsys)
    assert code == 1
    assert [p.split(":")[0] for p in record["integrity"]["problems"]] == [path.name]
    assert f"{path.name}: sha256 mismatch" in err


def test_bad_input_exits_with_the_code_every_command_gives_it(tmp_path, converted, capsys):
    code, out, err = run_cli(["verify", str(tmp_path / "nowhere")], capsys)
    assert code == 3 and "no such folder" in err and out == ""  # as inspect and quantize say
    code, _, err = run_cli(["verify", str(tmp_path)], capsys)
    assert code == 6 and "qconvert.json" in err  # a folder that is not a conversion: invalid
    code, _, err = run_cli(["verify", str(converted), "--reference", str(tmp_path / "missing")], capsys)
    assert code == 3 and "missing" in err
    code, _, err = run_cli(["verify", str(converted), "--backend", "fpga"], capsys)
    assert code == 2


def test_a_kernel_made_wrong_fails_fidelity_naming_the_kernel_and_backend(converted, capsys, monkeypatch):
    import importlib

    router = importlib.import_module("qconvert.kernels.qlinear")  # the one router from a QArray to its kernel

    right = router.int8_weight_matmul

    def wrong(x, w_q, w_scale, **kwargs):
        # A kernel bug: the last output column of every row comes out 3% too large.
        y, plan = right(x, w_q, w_scale, **kwargs)
        return y.at[:, -1].multiply(1.03), plan

    monkeypatch.setattr(router, "int8_weight_matmul", wrong)
    code, record, err = verify(converted, capsys)
    assert code == 1
    assert not record["fidelity_passed"]
    layer = record["layers"][0]
    assert not layer["fidelity_passed"] and layer["fidelity_sqnr_db"] < 60
    kernel = f"{layer['kernel']['name']} on {layer['kernel']['backend']}"
    assert f"fidelity: kernel {kernel} disagrees with the folder" in record["verdict"]
    assert "fidelity_sqnr_db" in record["verdict"].split(";")[0]
    assert "fidelity" in err


def test_an_honest_lossy_conversion_past_its_budget_fails_quality_saying_the_folder_is_faithful(
        tmp_path, capsys):
    source = make_llama_checkpoint(tmp_path / "src", **TINY)
    out = tmp_path / "nf4"
    assert run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nf4", "--quiet"], capsys)[0] == 0
    code, record, _ = verify(out, capsys)
    assert code == 0 and record["passed"], record["verdict"]
    # Ask NF4 for int8's per-layer budget: the conversion is faithful, the 4 bits cost more than that.
    code, record, _ = verify(out, capsys, "--min-sqnr", "30")
    assert code == 1
    assert record["fidelity_passed"] and not record["quality_passed"]
    assert "quality: the kernels and the folder agree" in record["verdict"]
    assert "the quantization itself costs this much" in record["verdict"]
    assert all(layer["fidelity_passed"] for layer in record["layers"])


def test_a_threshold_flag_can_fail_a_correct_conversion(converted, capsys):
    code, record, _ = verify(converted, capsys, "--min-sqnr", "99")
    assert code == 1
    assert record["thresholds"]["min_layer_sqnr_db"] == 99.0
    assert all(not r["passed"] for r in record["layers"])


def test_a_layer_that_fell_back_says_why_and_strict_fails_it(tmp_path, capsys):
    # hidden 96: K=96 is not a multiple of NF4's 64-blocks, so those layers cannot use the kernel;
    # down_proj (K=128) still can.
    source = make_llama_checkpoint(tmp_path / "src", hidden=96, layers=1, heads=4, kv_heads=4,
                                   intermediate=128, vocab=128)
    out = tmp_path / "nf4"
    with pytest.raises(SystemExit):
        main(["quantize", str(source), "-o", str(out), "--scheme", "nf4", "--quiet"])
    code, record, err = verify(out, capsys)
    assert code == 0, err
    layers = {r["name"]: r for r in record["layers"]}
    assert layers["model.layers.0.mlp.down_proj"]["kernel"]["name"] == "nf4_matmul_mosaic"
    fell_back = [r for r in layers.values() if not r["kernel"]["pallas"]]
    assert {r["name"].rsplit(".", 1)[1] for r in fell_back} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj"}
    for r in fell_back:
        assert r["kernel"]["name"] == "nf4_matmul_reference"
        assert "not a multiple of the NF4 block size" in r["kernel"]["fallback_reason"]
    assert "fallback:" in err
    code, record, _ = verify(out, capsys, "--strict")
    assert code == 1
    assert any("pallas_kernel" in f for f in record["failures"])


def test_a_source_changed_since_conversion_is_refused_unless_a_reference_is_given(tmp_path, capsys):
    source = make_llama_checkpoint(tmp_path / "src", **TINY)
    out = tmp_path / "int8"
    with pytest.raises(SystemExit):
        main(["quantize", str(source), "-o", str(out), "--scheme", "int8", "--quiet"])
    original = tmp_path / "original"
    shutil.copytree(source, original)
    make_llama_checkpoint(source, **{**TINY, "seed": 1})  # the folder now holds another model
    code, _, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu"], capsys)
    assert code == 2 and "model.safetensors: sha256 differs" in err
    code, record, err = verify(out, capsys, "--reference", str(original))
    assert code == 0, err
    assert record["reference"]["from"] == "--reference"


@pytest.mark.skipif(__import__("jax").default_backend() == "tpu", reason="needs a machine without a TPU")
def test_a_backend_the_machine_lacks_exits_2(converted, capsys):
    code, _, err = run_cli(["verify", str(converted), "--backend", "tpu"], capsys)
    assert code == 2 and "--backend tpu needs a TPU" in err


@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_strict_where_every_layer_runs_xlas_reference_says_what_to_pass(converted, capsys, backend):
    """--strict on a CPU failed every conversion with `pallas_kernel 0 < 1` and no hint of --backend cpu."""
    code, _, err = run_cli(["verify", str(converted), "--strict", "--backend", backend], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("qconvert: error: --strict fails every layer that runs XLA's reference")
    assert line.endswith("pass --backend cpu (the Pallas kernels, interpreted) with --strict on a CPU")
