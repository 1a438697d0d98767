"""DeepSeek-V3 (tiny, built by transformers: a dense layer, then routed and shared experts) in every scheme:
each converts, passes `qconvert verify` (the family's forward with the kernels, experts through the grouped
ones), and loads in transformers as the folder holds it: int8 and int4 to the float model holding qconvert's
dequantized weights, fp8 to it with activations rounded to fp8 as compressed-tensors rounds them; w8a8's int8
experts do not load there (vLLM loads them), and nf4 refuses the experts and converts with them excluded.
A multi-token-prediction layer, as the released checkpoints hold, is written unchanged and left to the loaders
to skip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from cli_helpers import run
from hf_checkpoints import dequantized_float_folder, load_config, make_hf_checkpoint, reference_logits, token_batch
from safetensors.numpy import load_file
from cli_helpers import servers_cell
from peer_references import cosine, max_rel

from qconvert.models.registry import family_for

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

CALIB = ("--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16")
# Whole-model ceilings for a tiny random model, whose peaked next-token distributions on random ids (float
# perplexity far above the vocabulary) make its KL and top-1 swing with any rounding. Measured here: KL 0.001
# int8, 0.003 w8a8, 0.08 fp8, 0.36 int4, 0.48 nf4; top-1 >= 0.54; perplexity ratio up to 1.39. What these
# tests hold is the forward and the kernels (fidelity, unchanged), not quality, which docs/ACCURACY.md
# measures on trained models.
TINY_MODEL_QUALITY = ("--max-kl", "1.0", "--min-top1", "0.4", "--max-ppl-ratio", "1.5")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # Widths bitsandbytes' CPU path reads back (no input width of 16, 32 or 96): nf4 loads in transformers.
    return make_hf_checkpoint(tmp_path_factory.mktemp("deepseek_v3") / "src", "deepseek_v3", hidden=64, layers=2,
                              kv_heads=4, intermediate=128, moe_intermediate_size=64, q_lora_rank=24,
                              kv_lora_rank=24, peaked=True)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    """scheme -> its folder, converted on first use."""
    root, folders = tmp_path_factory.mktemp("converted"), {}

    def folder(scheme, capsys, *flags):
        if scheme not in folders:
            code, _, err = run(["quantize", str(source), "-o", str(root / scheme), "--scheme", scheme, "-q",
                                *flags], capsys)
            assert code == 0, err
            folders[scheme] = root / scheme
        return folders[scheme]
    return folder


def verified(out, capsys, *flags) -> dict:
    code, report, err = run(["verify", str(out), "--quick", "--json", *TINY_MODEL_QUALITY, *flags], capsys)
    assert code == 0, err
    record = json.loads(report)
    assert record["passed"] and record["model"]["mean_kl"] is not None
    return record


@pytest.mark.parametrize("scheme, flags", [("int8", ()), ("int4", CALIB), ("w8a8", CALIB), ("fp8", ())])
def test_converts_and_passes_verify_with_every_linear_through_its_kernel(source, converted, scheme, flags,
                                                                          capsys):
    # int8 on the Pallas kernels (TPU kernels in interpret mode); the others on the XLA ones, which are faster.
    backend = ("--backend", "cpu") if scheme == "int8" else ()
    record = verified(converted(scheme, capsys, *flags), capsys, *backend)
    linears = family_for(load_config(source)).linear_names(load_file(str(source / "model.safetensors")))
    assert sorted(r["name"] for r in record["layers"]) == linears
    grouped = {r["name"] for r in record["layers"] if r["kernel"]["name"].startswith("grouped_matmul")}
    assert grouped == {m for m in linears if ".mlp.experts." in m}
    assert min(r["fidelity_sqnr_db"] for r in record["layers"]) >= 60


def test_w8a8_smooths_kv_b_proj_value_rows_into_o_proj_leaving_its_key_rows(source, converted, capsys):
    out = converted("w8a8", capsys, *CALIB)
    smoothing = json.loads((out / "qconvert.json").read_text())["smoothing"]
    assert smoothing["groups"]["model.layers.1.self_attn.kv_b_proj"] == ["model.layers.1.self_attn.o_proj"]
    assert smoothing["groups"]["model.layers.1.self_attn.kv_a_layernorm"] == ["model.layers.1.self_attn.kv_b_proj"]


@pytest.mark.parametrize("scheme, flags", [("int8", ()), ("int4", CALIB)])
def test_weight_only_folders_load_in_transformers_as_they_hold_them(source, converted, scheme, flags, tmp_path,
                                                                    capsys):
    out = converted(scheme, capsys, *flags)
    ids, mask = token_batch(load_config(source)["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # compressed-tensors decompresses the fused experts to float
    assert max_rel(loaded, reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask),
                   mask) <= 1e-4
    # Measured 0.9995 int8, 0.96 int4 (a token whose chosen experts nearly tie may switch expert).
    assert cosine(loaded, reference_logits(source, ids, mask), mask) >= (0.998 if scheme == "int8" else 0.9)
    assert servers_cell(out, capsys) == "yes"


def fp8_as_compressed_tensors_rounds(x):
    """x rounded to E4M3 on one scale (absmax / 448) per index of its first two dims: compressed-tensors'
    dynamic `token` strategy. That is one per token for [B, T, in], but DeepSeek-V3's kv_b_proj reads its
    latent as [B, 1, T, kv_lora_rank] in transformers, so there it is one scale per sequence."""
    scale = x.abs().amax(dim=tuple(range(2, x.ndim)), keepdim=True) / 448.0
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def test_fp8_loads_in_transformers_with_activations_rounded_as_compressed_tensors_does(source, converted, tmp_path,
                                                                                        capsys):
    import transformers
    from qconvert.formats.layouts import open_quantized

    out = converted("fp8", capsys)
    ids, mask = token_batch(load_config(source)["vocab_size"])
    meant = transformers.AutoModelForCausalLM.from_pretrained(
        str(dequantized_float_folder(source, out, tmp_path / "meant")), dtype=torch.float32).eval()
    named = dict(meant.named_modules())
    for module in open_quantized(out).quantized_modules:  # the fused experts have no Linear: not rounded
        if isinstance(named.get(module), torch.nn.Linear):
            named[module].register_forward_pre_hook(lambda _, args: (fp8_as_compressed_tensors_rounds(args[0]),))
    with torch.no_grad():
        want = meant(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()
    assert max_rel(reference_logits(out, ids, mask), want, mask) <= 1e-4
    assert servers_cell(out, capsys) == "yes"


def test_w8a8_experts_do_not_load_in_transformers(source, converted, capsys):
    out = converted("w8a8", capsys, *CALIB)
    ids, mask = token_batch(load_config(source)["vocab_size"])
    with pytest.raises(RuntimeError, match="conversion of the weights"):
        reference_logits(out, ids, mask)
    assert servers_cell(out, capsys) == "no"


def test_nf4_refuses_experts_and_with_them_excluded_converts_verifies_and_loads(source, tmp_path, capsys):
    out = tmp_path / "nf4"
    assert run(["quantize", str(source), "-o", str(out), "--scheme", "nf4", "-q"], capsys) == (2, "", (
        "qconvert: error: --scheme nf4 cannot quantize experts (model.layers.1.mlp.experts.0.down_proj and 11 "
        "more): transformers fuses them and its bitsandbytes 4-bit path keeps them float; use --scheme int4 "
        "(transformers and vLLM load its experts), or --exclude '*.experts.*' to keep them float\n"))
    assert not out.exists()
    code, _, err = run(["quantize", str(source), "-o", str(out), "--scheme", "nf4", "-q", "--exclude", "*.experts.*"],
                       capsys)
    assert code == 0, err
    record = verified(out, capsys)
    assert {r["name"] for r in record["layers"]} >= {"model.layers.1.mlp.shared_experts.down_proj",
                                                     "model.layers.1.self_attn.kv_b_proj"}
    ids, mask = token_batch(load_config(source)["vocab_size"])
    loaded = reference_logits(out, ids, mask)
    assert max_rel(loaded, reference_logits(dequantized_float_folder(source, out, tmp_path / "meant"), ids, mask),
                   mask) <= 1e-4


def with_mtp_layer(source, folder):
    """`source` with a multi-token-prediction layer after its last, as DeepSeek-V3's checkpoints hold one (layer
    61): a decoder layer with experts, plus its own embed_tokens, enorm, hnorm, eh_proj and shared_head."""
    import shutil

    from safetensors.numpy import save_file

    config, weights = load_config(source), load_file(str(source / "model.safetensors"))
    n, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}"
    weights.update({f"{mtp}.{name[len(last):]}": array.copy() for name, array in weights.items()
                    if name.startswith(last)})
    rng = np.random.default_rng(3)
    for name, shape in {"eh_proj.weight": (hidden, 2 * hidden), "enorm.weight": (hidden,),
                        "hnorm.weight": (hidden,), "shared_head.norm.weight": (hidden,),
                        "shared_head.head.weight": (vocab, hidden), "embed_tokens.weight": (vocab, hidden)}.items():
        weights[f"{mtp}.{name}"] = rng.standard_normal(shape).astype(np.float32)
    folder.mkdir()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(source / "config.json", folder / "config.json")
    assert config["num_nextn_predict_layers"] == 1  # as transformers writes DeepseekV3Config
    return folder


def test_a_multi_token_prediction_layer_is_written_unchanged_float_and_ignored(source, converted, tmp_path,
                                                                               capsys):
    mtp_source = with_mtp_layer(source, tmp_path / "src")
    out = tmp_path / "int8"
    code, _, err = run(["quantize", str(mtp_source), "-o", str(out), "--scheme", "int8", "-q"], capsys)
    assert code == 0, err
    mtp, written = "model.layers.2", load_file(str(out / "model.safetensors"))
    for name, array in load_file(str(mtp_source / "model.safetensors")).items():
        if name.startswith(f"{mtp}."):
            np.testing.assert_array_equal(written[name], array)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {f"{mtp}.self_attn.q_a_proj", f"{mtp}.mlp.experts.0.up_proj", f"{mtp}.mlp.gate", f"{mtp}.eh_proj",
            f"{mtp}.shared_head.head"} <= set(ignore)
    assert "model.layers.1.self_attn.q_a_proj" not in ignore  # the decoder's own are quantized
    verified(out, capsys)
    # The decoder the loaders run is the folder without that layer.
    ids, mask = token_batch(load_config(source)["vocab_size"])
    assert max_rel(reference_logits(out, ids, mask), reference_logits(converted("int8", capsys), ids, mask),
                   mask) == 0


def test_a_config_claiming_more_routed_experts_than_the_weights_hold_is_one_line_exit_6(source, tmp_path, capsys):
    import shutil

    folder = tmp_path / "src"
    shutil.copytree(source, folder)
    config = {**load_config(source), "n_routed_experts": 2 * 10**9}
    (folder / "config.json").write_text(json.dumps(config))
    assert run(["quantize", str(folder), "-o", str(tmp_path / "out"), "-q"], capsys) == (6, "", (
        "qconvert: error: config.json: n_routed_experts is 2000000000, but the weights hold 128 experts at most; "
        "the config does not fit the weights\n"))
    assert not (tmp_path / "out").exists()
