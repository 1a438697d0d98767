"""Mixtral, Qwen2-MoE and Qwen3-MoE in every scheme, as transformers 5.x loads them (experts fused into one 3-D
parameter per projection): int8 and int4 load to the model the folder holds, fp8 to it with activations
rounded to fp8 per token; w8a8 experts do not load in transformers (vLLM loads them); nf4 is refused at
quantize time, since transformers' bitsandbytes keeps experts float, and with the experts excluded it loads."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run, servers_cell
from hf_checkpoints import (
    dequantized_float_folder,
    load_config,
    make_hf_checkpoint,
    reference_logits,
    token_batch,
)
from peer_references import cosine, max_rel, meant_logits

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Whether transformers loads the folder does not depend on smoothing or searched scales: no calibration runs.
NO_CALIBRATION = ("--no-smooth", "--no-scale-search")


@pytest.fixture(scope="module", params=FAMILIES)
def source(request, tmp_path_factory):
    # intermediate 64: Qwen2-MoE and Qwen3-MoE have no dense MLP, so it may not exceed the widest tensor.
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "src", request.param, hidden=64,
                              layers=1, intermediate=64, peaked=True)


def quantize(source, out, scheme, capsys, *flags):
    return run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *flags], capsys)


def batch(source):
    return token_batch(load_config(source)["vocab_size"])


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_weight_only_experts_load_in_transformers_as_the_folder_holds_them(source, scheme, tmp_path, capsys):
    out = tmp_path / scheme
    # int4 rounds by GPTQ by default, each expert on the tokens routed to it: random ids calibrate it here.
    gptq = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"] if scheme == "int4" else []
    code, _, err = quantize(source, out, scheme, capsys, *gptq)
    assert code == 0, err
    ids, mask = batch(source)
    loaded = reference_logits(out, ids, mask)  # compressed-tensors decompresses the experts to float
    meant = reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask)
    assert max_rel(loaded, meant, mask) <= 1e-4
    # Against the float model: close, though a token whose top-k experts nearly tie may switch expert.
    assert cosine(loaded, reference_logits(source, ids, mask), mask) >= (0.995 if scheme == "int8" else 0.95)
    assert servers_cell(out, capsys) == "yes"


def test_fp8_experts_load_in_transformers(source, tmp_path, capsys):
    from qconvert.formats.layouts import open_quantized

    out = tmp_path / "fp8"
    code, _, err = quantize(source, out, "fp8", capsys)
    assert code == 0, err
    ids, mask = batch(source)
    meant, _ = meant_logits(dequantized_float_folder(source, out, tmp_path / "meant"),
                            open_quantized(out).quantized_modules, ids, mask)
    # Mixtral and Qwen3-MoE: exact. Qwen2-MoE: 0.8% of the logit scale (measured); its shared expert's
    # activations are rounded by transformers in a way these hooks do not reproduce exactly (not pinned down).
    limit = 0.02 if load_config(source)["model_type"] == "qwen2_moe" else 1e-4
    assert max_rel(reference_logits(out, ids, mask), meant, mask) <= limit
    assert servers_cell(out, capsys) == "yes"


def test_w8a8_experts_do_not_load_in_transformers(source, tmp_path, capsys):
    out = tmp_path / "w8a8"
    code, _, err = quantize(source, out, "w8a8", capsys, *NO_CALIBRATION)
    assert code == 0, err
    ids, mask = batch(source)
    # Its compressed-tensors path has no int8 expert to fuse; vLLM loads the folder (test_vllm_accept.py).
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        reference_logits(out, ids, mask)
    assert servers_cell(out, capsys) == "no"


def test_nf4_refuses_experts_in_one_line_and_loads_with_them_excluded(source, tmp_path, capsys):
    config = load_config(source)
    experts = config.get("num_local_experts") or config["num_experts"]
    first = ("model.layers.0.block_sparse_moe.experts.0.w1" if config["model_type"] == "mixtral"
             else "model.layers.0.mlp.experts.0.down_proj")
    out = tmp_path / "nf4"
    assert quantize(source, out, "nf4", capsys) == (2, "", (
        f"qconvert: error: --scheme nf4 cannot quantize experts ({first} and {3 * experts - 1} more): "
        "transformers fuses them and its bitsandbytes 4-bit path keeps them float; use --scheme int4 "
        "(transformers and vLLM load its experts), or --exclude '*.experts.*' to keep them float\n"))
    assert not out.exists()
    code, _, err = quantize(source, out, "nf4", capsys, "--exclude", "*.experts.*")
    assert code == 0, err
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert first in skip
    ids, mask = batch(source)
    loaded = reference_logits(out, ids, mask)
    assert max_rel(loaded, reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask),
                   mask) <= 1e-4
