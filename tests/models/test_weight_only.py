"""--any-architecture: an unknown decoder converts weight-only (int8, nf4) by the layer-prefix rule,
is refused clearly without the flag or for w8a8, and verifies without a forward pass."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from checkpoints import make_mixtral_checkpoint  # noqa: E402
from cli_helpers import run  # noqa: E402
from qconvert.cli.main import main  # noqa: E402
from qconvert.formats.errors import UnsupportedModelError  # noqa: E402
from qconvert.models.weight_only import select_linears  # noqa: E402


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A tiny GPT-NeoX (a decoder qconvert has no family for), built and saved by transformers."""
    folder = tmp_path_factory.mktemp("neox") / "src"
    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=96, max_position_embeddings=64)
    config.architectures = ["GPTNeoXForCausalLM"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    # The independent list of what is a linear inside the layer stack: torch's own modules.
    linears = sorted(name for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and name.startswith("gpt_neox.layers."))
    return folder, linears


def neox_logits(folder, ids, weights=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if weights:
        _, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        assert not unexpected
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def rel_error(got, ref):
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def test_unknown_architecture_without_the_flag_is_refused_naming_the_flag(neox, tmp_path, capsys):
    folder, _ = neox
    code, out, err = run(["quantize", str(folder), "-o", str(tmp_path / "out")], capsys)
    assert code == 5 and not out
    assert len(err.strip().splitlines()) == 1
    assert "GPTNeoXForCausalLM" in err and "--any-architecture" in err
    assert not (tmp_path / "out").exists()


def test_w8a8_with_the_flag_says_it_needs_a_known_family(neox, tmp_path, capsys):
    folder, _ = neox
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                        "--any-architecture", "--calib", "random"], capsys)
    assert code == 5 and len(err.strip().splitlines()) == 1
    assert "w8a8 needs a known family" in err
    assert not (tmp_path / "out").exists()


def test_dry_run_lists_every_linear_of_the_layer_stack_and_nothing_else(neox, tmp_path, capsys):
    folder, linears = neox
    code, out, _ = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--any-architecture",
                        "--dry-run", "--json"], capsys)
    assert code == 0 and not (tmp_path / "out").exists()
    summary = json.loads(out)
    quantized = sorted(t["name"] for t in summary["tensors"] if t["kind"] == "int8")
    assert quantized == linears
    assert summary["weight_only"]["layer_prefix"] == "gpt_neox.layers"
    code, out, _ = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--any-architecture",
                        "--dry-run"], capsys)
    assert "every 2-D weight under gpt_neox.layers.N" in " ".join(out.split())


@pytest.fixture(scope="module")
def neox_int8(neox, tmp_path_factory):
    folder, _ = neox
    out = tmp_path_factory.mktemp("neox_int8") / "int8"
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(folder), "-o", str(out), "--any-architecture", "--quiet"])
    assert exc.value.code == 0
    return out


def test_int8_weights_dequantized_by_compressed_tensors_give_transformers_the_float_logits(neox, neox_int8):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file as load_torch

    folder, linears = neox
    qconfig = QuantizationConfig.model_validate(
        json.loads((neox_int8 / "config.json").read_text())["quantization_config"])
    stored = load_torch(str(neox_int8 / "model.safetensors"))
    source = load_file(str(folder / "model.safetensors"))
    written = load_file(str(neox_int8 / "model.safetensors"))
    dequantized = {}
    for m in linears:
        state = {k: stored[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        dequantized[f"{m}.weight"] = PackedQuantizationCompressor.decompress(
            state, qconfig.config_groups["group_0"])["weight"].numpy()
    # Embeddings, norms, biases and the head are written as the source holds them.
    for name, array in source.items():
        if not any(name == f"{m}.weight" for m in linears):
            np.testing.assert_array_equal(written[name], array, err_msg=name)
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 16))
    float_logits = neox_logits(folder, ids)
    int8_logits = neox_logits(folder, ids, dequantized)
    # Measured 0.8% relative error on the logits (a wrong scale or layout gives ~100%).
    assert 1e-5 < rel_error(int8_logits, float_logits) < 0.02
    # transformers loads the folder itself (compressed-tensors decompressing on load) to the same model.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(neox_int8)).eval()
    with torch.no_grad():
        assert rel_error(loaded(torch.tensor(ids)).logits.float().numpy(), int8_logits) < 1e-5


def test_nf4_folder_loads_in_transformers_with_bitsandbytes(neox, tmp_path, capsys):
    import bitsandbytes

    folder, _ = neox
    out = tmp_path / "nf4"
    code, _, err = run(["quantize", str(folder), "-o", str(out), "--scheme", "nf4", "--any-architecture",
                        "--quiet"], capsys)
    assert code == 0, err
    quantized = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(quantized.gpt_neox.layers[0].mlp.dense_h_to_4h, bitsandbytes.nn.Linear4bit)
    ids = np.random.default_rng(0).integers(0, 96, size=(2, 16))
    with torch.no_grad():
        logits = quantized(torch.tensor(ids)).logits.float().numpy()
    # Measured 12% relative error on this random model's small logits (NF4 blocks of 64);
    # a misread layout gives ~100%.
    assert rel_error(logits, neox_logits(folder, ids)) < 0.3


def test_verify_runs_every_linear_through_its_kernel_and_says_what_it_skipped(neox, neox_int8, capsys):
    _, linears = neox
    code, out, err = run(["verify", str(neox_int8), "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    record = json.loads(out)
    assert record["passed"] and record["model"] is None
    assert sorted(r["name"] for r in record["layers"]) == linears
    assert all(r["kernel"]["name"] == "int8_weight_matmul_mosaic" for r in record["layers"])
    assert len(record["skipped"]) == 2 and all("no forward pass" in line for line in record["skipped"])
    assert "skipped: whole model" in err


def test_verify_of_a_weight_only_folder_fails_a_wrong_scale(neox_int8, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(neox_int8, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "gpt_neox.layers.1.mlp.dense_4h_to_h.weight_scale"
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    manifest = json.loads((bad / "qconvert.json").read_text())
    manifest["files"]["model.safetensors"] = hashlib.sha256((bad / "model.safetensors").read_bytes()).hexdigest()
    (bad / "qconvert.json").write_text(json.dumps(manifest))
    code, out, _ = run(["verify", str(bad), "--backend", "cpu", "--json", "-"], capsys)
    assert code == 1
    failed = {r["name"] for r in json.loads(out)["layers"] if not r["passed"]}
    assert failed == {"gpt_neox.layers.1.mlp.dense_4h_to_h"}


def test_a_known_family_keeps_its_own_linears_with_the_flag(tmp_path, capsys):
    # Mixtral's router (block_sparse_moe.gate) is 2-D under model.layers.N, but the family keeps it float.
    src = make_mixtral_checkpoint(tmp_path / "mixtral", layers=1)
    runs = []
    for flags in ((), ("--any-architecture",)):
        code, out, _ = run(["quantize", str(src), "-o", str(tmp_path / "x"), "--dry-run", "--json", *flags],
                           capsys)
        assert code == 0
        runs.append(json.loads(out))
    assert runs[0]["tensors"] == runs[1]["tensors"] and runs[1]["weight_only"] is None
    kinds = {t["name"]: t["kind"] for t in runs[1]["tensors"]}
    assert kinds["model.layers.0.block_sparse_moe.gate.weight"] == "unchanged"


def test_the_layer_stack_is_the_numbered_prefix_holding_the_most_tensors():
    shapes = {"vision.blocks.0.fc.weight": (8, 8),
              "lm.layers.0.attn.qkv.weight": (24, 8), "lm.layers.0.norm.weight": (8,),
              "lm.layers.1.attn.qkv.weight": (24, 8), "lm.layers.1.norm.weight": (8,),
              "lm.layers.1.tok_embed.weight": (50, 8), "lm.layers.1.mask.weight": (8, 8),
              "lm.embed.weight": (50, 8), "head.weight": (50, 8)}
    dtypes = {name: "float32" for name in shapes} | {"lm.layers.1.mask.weight": "int8"}
    selection = select_linears({"architectures": ["Toy"]}, shapes, dtypes)
    assert (selection.layer_prefix, selection.layers, selection.modules) == ("lm.layers", 2, ("attn.qkv",))
    with pytest.raises(UnsupportedModelError, match="no numbered layers"):
        select_linears({"architectures": ["Toy"]}, {"embed.weight": (4, 4)}, {"embed.weight": "float32"})
