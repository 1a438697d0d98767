"""--kv-cache fp8: per-tensor k_scale / v_scale from calibration's keys (after RoPE) and values, judged by
transformers' own KV cache; the folder transformers loads; verify recomputing the scales and failing an edit."""

import hashlib
import json

import numpy as np
import pytest
from checkpoints import make_bert_checkpoint
from cli_helpers import quantize_quietly, run
from hf_checkpoints import make_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from qconvert.calibration.data import RANDOM_SEED, random_windows

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("kv") / "src", "llama", layers=2, peaked=True)


def _tensors(folder):
    import torch  # noqa: F401  (safe_open's pt framework)

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


def _cached_absmax(source, ids):
    """max|k| and max|v| per layer of transformers' own KV cache (keys after RoPE) over the windows."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.as_tensor(ids), use_cache=True).past_key_values
    return [(float(layer.keys.abs().max()), float(layer.values.abs().max())) for layer in cache.layers]


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_scales_are_the_calibrated_maxima_of_the_cache_over_448(llama, tmp_path, scheme):
    out = quantize_quietly(llama, tmp_path / scheme, "--scheme", scheme, "--kv-cache", "fp8", *CALIB)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "tensor"
    assert config["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    tensors = _tensors(out)
    ids = random_windows(config["vocab_size"], 4, 16, RANDOM_SEED)
    for i, (keys, values) in enumerate(_cached_absmax(llama, ids)):
        k, v = tensors[f"model.layers.{i}.self_attn.k_scale"], tensors[f"model.layers.{i}.self_attn.v_scale"]
        assert str(k.dtype) == "torch.float32" and tuple(k.shape) == (1,)
        if scheme == "fp8":  # every layer calibrated on the float model: transformers' own cache
            np.testing.assert_allclose(float(k), keys / 448, rtol=1e-5)
            np.testing.assert_allclose(float(v), values / 448, rtol=1e-5)
        else:  # GPTQ rounds layer 0 first: layer 1 sees it rounded, so only layer 0 is the float model's
            if i == 0:
                np.testing.assert_allclose([float(k), float(v)], [keys / 448, values / 448], rtol=1e-5)
            assert 0.5 < float(k) * 448 / keys < 2 and 0.5 < float(v) * 448 / values < 2


@pytest.mark.parametrize("family,overrides", [("gemma3", {"sliding_window": 64}), ("qwen3_moe", {})])
def test_other_families_scales_are_their_caches_maxima_too(tmp_path, family, overrides):
    """Gemma 3 (per-head q/k norms, its own RoPE per layer type; a window longer than the text, so transformers'
    cache keeps every token) and a MoE (the cache is attention's alone)."""
    source = make_hf_checkpoint(tmp_path / "src", family, layers=2, **overrides)
    out = quantize_quietly(source, tmp_path / "out", "--scheme", "fp8", "--kv-cache", "fp8", *CALIB)
    tensors = _tensors(out)
    ids = random_windows(json.loads((out / "config.json").read_text())["vocab_size"], 4, 16, RANDOM_SEED)
    for i, (keys, values) in enumerate(_cached_absmax(source, ids)):
        np.testing.assert_allclose(float(tensors[f"model.layers.{i}.self_attn.k_scale"]), keys / 448, rtol=1e-5)
        np.testing.assert_allclose(float(tensors[f"model.layers.{i}.self_attn.v_scale"]), values / 448, rtol=1e-5)


def test_transformers_loads_the_folder_and_verify_recomputes_the_scales(llama, tmp_path, capsys):
    import torch
    import transformers

    out = quantize_quietly(llama, tmp_path / "out", "--scheme", "fp8", "--kv-cache", "fp8", *CALIB)
    card = (out / "README.md").read_text()
    assert 'kv_cache_dtype="fp8")' in card and "| KV cache | fp8 scales per tensor" in card  # served as meant
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    ids = torch.as_tensor(random_windows(128, 2, 12, 9))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    code, stdout, _ = run(["verify", str(out), "--quick", "--json"], capsys)
    assert code == 0, stdout
    # One scale edited (the file's sha256 recorded again, so only the scale check can tell): verify fails.
    record = json.loads((out / "qconvert.json").read_text())
    name = "model.layers.1.self_attn.v_scale"
    path = next(p for p in out.glob("*.safetensors") if name in safe_open(p, "pt").keys())
    tensors = {k: v for k, v in _tensors(out).items() if k in safe_open(path, "pt").keys()}
    tensors[name] = tensors[name] * 1.01
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    save_file(tensors, path, metadata=metadata)
    record["files"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / "qconvert.json").write_text(json.dumps(record))
    code, stdout, stderr = run(["verify", str(out), "--quick"], capsys)
    assert code != 0 and name in stdout + stderr, stdout + stderr


@pytest.mark.parametrize("case", ["nf4", "bert", "deepseek_v3", "act-stats", "any-architecture"])
def test_where_no_loader_reads_the_scales_the_flag_is_refused_in_one_line(tmp_path, capsys, case):
    if case == "bert":
        source, args = make_bert_checkpoint(tmp_path / "bert"), ["--scheme", "int8"]
    elif case == "deepseek_v3":
        source, args = make_hf_checkpoint(tmp_path / "ds", "deepseek_v3", layers=2), ["--scheme", "fp8"]
    elif case == "any-architecture":  # a decoder of no known family converts weight-only: no forward to calibrate
        source, args = _neox(tmp_path / "neox"), ["--scheme", "int8", "--any-architecture"]
    else:
        source = make_hf_checkpoint(tmp_path / "llama", "llama", layers=1)
        args = ["--scheme", "nf4"] if case == "nf4" else ["--scheme", "w8a8", "--act-stats", str(tmp_path / "s")]
    capsys.readouterr()  # what building the source printed
    code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "-q", "--kv-cache", "fp8",
                           *args, *([] if case == "act-stats" else CALIB)], capsys)
    assert code == 2 and "--kv-cache" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "out").exists()


def test_vllm_tpu_default_path_is_said_not_to_read_the_scales_for_its_jax_models():
    """Measured (docs/BENCHMARKS.md, "KV-cache FP8 scales"): tpu-inference's JAX Llama and Qwen3 keep scale 1.0,
    and its Qwen3 loader refuses the tensors; its vLLM path reads them."""
    from qconvert.schemes.servers import kv_cache_note, servers

    assert servers("fp8", "qwen3")["vLLM TPU"] == "yes"
    with_scales = servers("fp8", "qwen3", kv_cache=True)
    assert with_scales["vLLM TPU"] == "no" and with_scales["vLLM TPU MODEL_IMPL_TYPE=vllm"] == "yes"
    assert servers("fp8", "qwen3_moe", kv_cache=True)["vLLM TPU"] == "yes"  # falls back to the vLLM path
    assert "MODEL_IMPL_TYPE=vllm" in kv_cache_note("llama") and kv_cache_note("mixtral") == ""


def _neox(folder):
    import torch
    import transformers

    config = transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, vocab_size=96, max_position_embeddings=64)
    config.architectures = ["GPTNeoXForCausalLM"]
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    return folder
