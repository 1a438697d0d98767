"""Folders mean to the loaders what they mean to qconvert: routers and GPT-2-style Conv1Ds stay float, every
float linear (a tied head under its family's own name included) is in the loader's ignore list, and verify's
integrity stage fails a folder that breaks this, naming the module. Tiny random models built by transformers
(OLMoE, GraniteMoE, GPT-2, BioGPT under --any-architecture; DeepSeek-V3 with it, its own family) load in
transformers to the model the folder holds."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from cli_helpers import run
from hf_checkpoints import dequantized_float_folder, generic_bitsandbytes_path
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SMALL = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
MODELS = {
    # Routers: OLMoE's `mlp.gate` (an OlmoeTopKRouter in transformers), GraniteMoE's `router.layer`.
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, intermediate_size=32, num_key_value_heads=2,
                                              num_experts=4, num_experts_per_tok=2),
    "granitemoe": lambda: transformers.GraniteMoeConfig(**SMALL, intermediate_size=32, num_key_value_heads=2,
                                                        num_local_experts=4, num_experts_per_tok=2),
    # n_routed_experts; the first layer dense, the second MoE.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SMALL, "num_hidden_layers": 2}, intermediate_size=64, moe_intermediate_size=32, first_k_dense_replace=1,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64),
    # A tied head named output_projection, not lm_head.
    "biogpt": lambda: transformers.BioGptConfig(**SMALL, intermediate_size=96, max_position_embeddings=64),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> folder of a tiny random model saved by transformers (built once, on first use)."""
    root, built = tmp_path_factory.mktemp("sources"), {}
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar would land in captured stderr

    def source(name):
        if name not in built:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(MODELS[name](), dtype=torch.float32)
            model.save_pretrained(str(root / name))
            built[name] = root / name
        return built[name]
    return source


def logits(folder, ids) -> np.ndarray:
    model = generic_bitsandbytes_path(
        transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval())
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def quantize(source, out, scheme, capsys, *flags):
    code, _, err = run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "--any-architecture", "-q",
                        *flags], capsys)
    assert code == 0, err
    return json.loads((out / "config.json").read_text())["quantization_config"]


def ignore_list(qconfig) -> list[str]:
    return qconfig.get("ignore", qconfig.get("llm_int8_skip_modules"))


def integrity_problems(folder, capsys) -> tuple[int, list[str]]:
    code, out, _ = run(["verify", str(folder), "--quick", "--json", "-"], capsys)
    return code, json.loads(out)["integrity"]["problems"]


IDS = np.random.default_rng(0).integers(3, 128, size=(2, 10))


@pytest.mark.parametrize("name, router", [("olmoe", "model.layers.0.mlp.gate"),
                                          ("granitemoe", "model.layers.0.block_sparse_moe.router.layer"),
                                          ("deepseek_v3", "model.layers.1.mlp.gate")])
def test_routers_stay_float_and_the_folder_loads_as_the_model_it_holds(sources, name, router, tmp_path, capsys):
    source, out = sources(name), tmp_path / "int8"
    code, listing, _ = run(["quantize", str(source), "-o", str(out), "--any-architecture", "--dry-run", "--json"],
                           capsys)
    # DeepSeek-V3 is a known family, whose own list never selects its router: nothing is kept back from it.
    assert code == 0 and json.loads(listing)["kept_float"]["routers"] == ([] if name == "deepseek_v3" else [router])
    qconfig = quantize(source, out, "int8", capsys)
    assert router in ignore_list(qconfig)
    written, stored = load_file(str(out / "model.safetensors")), load_file(str(source / "model.safetensors"))
    np.testing.assert_array_equal(written[f"{router}.weight"], stored[f"{router}.weight"])
    loaded = logits(out, IDS)
    # transformers + compressed-tensors give the float model holding qconvert's own dequantized weights
    # (a router read back at random gave 23-78% relative error), within int8's error of the float model.
    assert rel(loaded, logits(dequantized_float_folder(source, out, tmp_path / "meant"), IDS)) < 1e-5
    assert rel(loaded, logits(source, IDS)) < 0.03
    assert integrity_problems(out, capsys) == (0, [])


def test_a_quantized_router_fails_verify_integrity_naming_it(sources, tmp_path, capsys, monkeypatch):
    import qconvert.plan

    # What quantize wrote before routers were recognised: every 2-D weight under the layers, the router too.
    monkeypatch.setattr(qconvert.plan, "loader_float", lambda ckpt, config, modules: ([], []))
    quantize(sources("olmoe"), tmp_path / "bad", "int8", capsys)
    code, problems = integrity_problems(tmp_path / "bad", capsys)
    assert code == 1
    assert problems == [("model.layers.0.mlp.gate: a router, quantized; loaders build routers unquantized and "
                         "would not read it (the model would route with random weights)")]


def test_an_include_of_a_router_alone_is_refused(sources, tmp_path, capsys):
    code, out, err = run(["quantize", str(sources("olmoe")), "-o", str(tmp_path / "x"), "--any-architecture",
                          "--include", "*.mlp.gate"], capsys)
    assert (code, out) == (2, "")
    assert err == ("qconvert: error: --include *.mlp.gate matches only routers or Conv1D linears "
                   "(model.layers.0.mlp.gate), which stay float: no loader reads them back quantized; leave it "
                   "out of --include\n")


GPT2_REFUSAL = ("qconvert: error: GPT2LMHeadModel: nothing left to quantize: every linear is a router or a "
                "GPT-2-style Conv1D with an [in, out] weight (transformer.h.0.attn.c_attn and 3 more), and those "
                "stay float: the loaders do not read them back quantized\n")


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_gpt2_conv1ds_stay_float_so_nothing_is_left_and_the_dry_run_lists_before_refusing(sources, scheme,
                                                                                          tmp_path, capsys):
    source, out = sources("gpt2"), tmp_path / "out"
    code, listing, err = run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "--any-architecture",
                              "--dry-run", "--json"], capsys)
    assert (code, err) == (5, GPT2_REFUSAL)
    summary = json.loads(listing)  # one document: the listing, ending in the refusal (no second error document)
    assert summary["refusal"] == summary["error"] == GPT2_REFUSAL[len("qconvert: error: "):-1]
    assert summary["exit_code"] == 5
    assert summary["kept_float"]["conv1d"] == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                               "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert {t["kind"] for t in summary["tensors"]} == {"unchanged"}
    code, table, err = run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "--any-architecture",
                            "--dry-run"], capsys)
    assert code == 5 and "transformer.h.0.attn.c_attn" in table and "would refuse" in table
    assert err == ("qconvert: kept float: transformer.h.0.attn.c_attn and 3 more (Conv1D, its weight stored [in, "
                   "out]: compressed-tensors leaves Conv1D float, and no transposed copy is written for "
                   "bitsandbytes)\n" + GPT2_REFUSAL)
    assert run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "--any-architecture", "-q"],
               capsys) == (5, "", GPT2_REFUSAL)
    assert not out.exists()


def test_a_conv1d_written_as_a_linear_fails_verify_integrity_naming_it(sources, tmp_path, capsys, monkeypatch):
    import qconvert.plan

    # The square Conv1D (attn.c_proj, [64, 64]) is the one the old rule could write: the others' biases
    # do not fit a [out, in] reading of their weights.
    monkeypatch.setattr(qconvert.plan, "loader_float", lambda ckpt, config, modules: ([], []))
    quantize(sources("gpt2"), tmp_path / "bad", "nf4", capsys, "--exclude", "*.c_attn", "--exclude", "*.mlp.*")
    code, problems = integrity_problems(tmp_path / "bad", capsys)
    assert code == 1
    assert problems == [("transformer.h.0.attn.c_proj: a GPT-2-style Conv1D weight ([in, out]) written as a "
                         "linear [out, in]; the loader would read it transposed, or not at all")]


@pytest.mark.parametrize("scheme, key", [("int8", "ignore"), ("nf4", "llm_int8_skip_modules")])
def test_biogpt_tied_head_is_in_the_loaders_ignore_list_and_the_folder_loads(sources, scheme, key, tmp_path,
                                                                              capsys):
    source, out = sources("biogpt"), tmp_path / scheme
    qconfig = quantize(source, out, scheme, capsys)
    assert qconfig[key] == ["output_projection"]
    loaded = logits(out, IDS)
    assert rel(loaded, logits(dequantized_float_folder(source, out, tmp_path / "meant"), IDS)) < 1e-5
    assert rel(loaded, logits(source, IDS)) < (0.03 if scheme == "int8" else 0.1)
    assert integrity_problems(out, capsys) == (0, [])
    # The same folder without its head in the list: the loader would quantize the head it re-ties.
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"][key] = []
    (bad / "config.json").write_text(json.dumps(config))
    record = json.loads((bad / "qconvert.json").read_text())
    record["files"]["config.json"] = hashlib.sha256((bad / "config.json").read_bytes()).hexdigest()
    (bad / "qconvert.json").write_text(json.dumps(record))
    code, problems = integrity_problems(bad, capsys)
    assert code == 1
    assert problems == [("output_projection: kept float, but the loader would quantize it: the "
                         "quantization_config's ignore list does not name it")]


def test_the_loaders_matching_rules_are_the_libraries_own():
    from compressed_tensors.utils.match import match_name
    from qconvert.formats import compressed_tensors as ct
    from qconvert.formats.layout_nf4 import BitsandbytesNF4
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.11.mlp.gate",
             "model.layers.1.mlp.experts.0.up_proj", "biogpt.layers.0.fc1", "output_projection"]
    entries = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1", "re:.*experts.*", "fc1", "output_projection"]
    nf4 = BitsandbytesNF4()
    for name in names:
        for entry in entries:
            assert ct.matches_name(name, entry) == match_name(name, entry), (name, entry)
            expected = should_convert_module(name, [entry])
            assert nf4.loader_quantizes({"llm_int8_skip_modules": [entry]}, name) == expected, (name, entry)


@pytest.mark.parametrize("config", [{"num_experts": 8}, {"num_local_experts": 8}, {"n_routed_experts": 8},
                                    {"text_config": {"num_experts": 8}}])
def test_a_linear_as_wide_as_the_expert_count_is_a_router_whatever_its_name(config):
    from qconvert.models.module_roles import expert_count, is_router

    experts = expert_count(config)
    assert experts == 8
    assert is_router("model.layers.0.mlp.switch", 8, experts)
    assert not is_router("model.layers.0.mlp.gate_proj", 16, experts)
    assert not is_router("model.layers.0.mlp.switch", 8, expert_count({"num_experts": 1}))  # a dense model
