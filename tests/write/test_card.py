"""The model card quantize writes into OUT (README.md), and the verification section `verify --update-card` adds."""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer
from cli_helpers import quantize_quietly, run
from safetensors.numpy import load_file

from qconvert.formats.record import ConversionRecord, SourceRecord
from qconvert.write.card import CardFacts, model_card

FOLDER = "path/to/this/folder"


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("card") / "src")
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return quantize_quietly(source, tmp_path_factory.mktemp("card-out") / "int8")


def test_card_names_source_scheme_flags_size_and_how_to_load(source, converted):
    card = (converted / "README.md").read_text()
    assert f"| source | `{source.name}` (a local folder; no Hub commit) |" in card
    assert str(source.parent) not in card  # no local path in a folder meant for publishing
    assert "| scheme | `int8` (compressed-tensors layout) |" in card
    # Only the flags that shaped the folder: not the scheme (its own row), nothing unset, off or empty, and no
    # activation mode for a weight-only scheme (qconvert.json records them all).
    [flags] = [line for line in card.splitlines() if line.startswith("| flags |")]
    assert flags == "| flags | `max_shard_size=5368709120` |"
    # Sizes from the tensors themselves: every source tensor, and every tensor written.
    float_bytes = sum(a.nbytes for a in load_file(str(source / "model.safetensors")).values())
    stored_bytes = sum(a.nbytes for a in load_file(str(converted / "model.safetensors")).values())
    mib = f"{float_bytes / 2**20:.1f} MiB -> {stored_bytes / 2**20:.1f} MiB ({float_bytes / stored_bytes:.2f}x smaller)"
    assert f"| size | {mib}; 14 linears quantized," in card
    vllm, hf = code_blocks(card)
    assert f'llm = LLM(model="{FOLDER}")' in vllm and "llm.generate(" in vllm
    assert f'model = AutoModelForCausalLM.from_pretrained("{FOLDER}")' in hf
    assert "pip install transformers compressed-tensors" in card
    assert str(converted) not in card and not re.search(r"\d{4}-\d\d-\d\d", card)


def test_card_is_listed_in_qconvert_json_and_the_same_bytes_on_a_second_run(source, converted, tmp_path, capsys):
    record = json.loads((converted / "qconvert.json").read_text())
    assert record["files"]["README.md"] == sha256(converted / "README.md")
    again = tmp_path / "elsewhere"
    code, _, err = run(["quantize", str(source), "-o", str(again), "-q"], capsys)
    assert code == 0, err
    assert (again / "README.md").read_bytes() == (converted / "README.md").read_bytes()


def test_an_edited_card_fails_verify_integrity(converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "out")
    with open(out / "README.md", "a") as f:
        f.write("Better than the original!\n")
    code, stdout, _ = run(["verify", str(out), "--quick", "--json"], capsys)
    record = json.loads(stdout)
    assert code == 1 and record["verdict"].startswith(f"FAIL int8 {out}: integrity: README.md: ")


def test_update_card_writes_the_verdict_and_rehashes_the_card(converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "out")
    before = (out / "README.md").read_text()
    code, stdout, stderr = run(["verify", str(out), "--quick", "--json", "--update-card"], capsys)
    record = json.loads(stdout)
    card = (out / "README.md").read_text()
    assert code == 0 and stderr.splitlines()[-1] == f"qconvert: wrote the verification section of {out}/README.md"
    assert card.startswith(before.rstrip("\n") + "\n\n<!-- qconvert verify: begin -->\n## Verification\n")
    verdict = record["verdict"].replace(f" {out}:", ":")
    assert f"`qconvert verify`: **{verdict}**" in card
    assert "- evaluation text: " in card and f"- per linear ({len(record['layers'])}): SQNR worst " in card
    assert json.loads((out / "qconvert.json").read_text())["files"]["README.md"] == sha256(out / "README.md")
    assert not [p.name for p in out.iterdir() if "qconvert-tmp" in p.name]
    # The updated folder passes its own check, and a second update replaces the section (same figures, same bytes).
    code, _, _ = run(["verify", str(out), "--quick", "-q", "--update-card"], capsys)
    assert code == 0 and (out / "README.md").read_text() == card and card.count("## Verification") == 1
    code, _, _ = run(["inspect", str(out)], capsys)
    assert code == 0


def test_update_card_leaves_a_folder_that_failed_integrity_alone(converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "out")
    with open(out / "config.json", "a") as f:
        f.write(" ")
    card, record = (out / "README.md").read_bytes(), (out / "qconvert.json").read_bytes()
    code, _, stderr = run(["verify", str(out), "--quick", "--update-card"], capsys)
    assert code == 1 and stderr.splitlines()[-1] == (
        f"qconvert: {out}/README.md not updated: the folder failed its integrity check")
    assert (out / "README.md").read_bytes() == card and (out / "qconvert.json").read_bytes() == record


def test_card_of_a_hub_model_names_base_model_and_commit_and_nf4_has_no_vllm_snippet():
    record = ConversionRecord("nf4", {}, SourceRecord("org/tiny-bert", True, "main", "a" * 40), "0.1.0",
                              {"double_quant": True})
    card = model_card(CardFacts(record=record, quant_method="bitsandbytes", scheme_summary="NormalFloat-4",
                                loads_in="transformers + bitsandbytes only", vllm_loads=False, causal_lm=False,
                                architecture="BertModel", quantized_linears=36, unchanged_tensors=68,
                                input_bytes=3 * 2**20, output_bytes=2**20))
    assert card.startswith("---\nbase_model: org/tiny-bert\nbase_model_relation: quantized\n")
    assert f"| source | [`org/tiny-bert`](https://huggingface.co/org/tiny-bert), commit `{'a' * 40}` |" in card
    assert "| size | 3.0 MiB -> 1.0 MiB (3.00x smaller); 36 linears quantized, 68 tensors unchanged |" in card
    assert "vLLM: does not load this layout (transformers + bitsandbytes only)." in card
    [hf] = code_blocks(card)
    assert f'model = AutoModel.from_pretrained("{FOLDER}")' in hf and "pip install transformers bitsandbytes" in card


def test_the_cards_transformers_snippet_loads_the_folders_own_int8_weights(converted):
    pytest.importorskip("compressed_tensors")
    hf = code_blocks((converted / "README.md").read_text())[1].replace(FOLDER, str(converted))
    namespace: dict = {}
    exec(compile(hf, "README.md", "exec"), namespace)  # noqa: S102 - the card's own code, as a reader runs it
    loaded = namespace["model"].model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    # README's int8 layout, decoded by hand: four codes per int32 word, lowest byte first, stored as code + 128.
    tensors = load_file(str(converted / "model.safetensors"))
    words = tensors["model.layers.0.self_attn.q_proj.weight_packed"]
    codes = words.view(np.uint8).reshape(words.shape[0], -1).astype(np.int32) - 128
    expected = codes[:, :loaded.shape[1]] * tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    np.testing.assert_allclose(loaded, expected, rtol=1e-6, atol=0)


def test_the_card_says_how_the_weights_were_rounded_and_what_loading_needs(tmp_path, capsys):
    """The card never said GPTQ rounded the weights, and its nf4 install line lacked accelerate (transformers
    raises ImportError without it)."""
    from cli_helpers import run

    source = make_llama_checkpoint(tmp_path / "src")
    for scheme, extra, install, rounding in (
            ("int4", ["--calib", "random"], "pip install transformers compressed-tensors`",
             "| rounding | AWQ's per-channel scales (searched on the calibration text below, folded into the norms "
             "and linears before them), then GPTQ (dampening 0.1, act order on) on the calibration text below |"),
            ("nf4", [], "pip install transformers bitsandbytes accelerate`", "| rounding | to nearest |")):
        out = tmp_path / scheme
        assert run(["quantize", str(source), "-o", str(out), "--scheme", scheme, *extra, "-q"], capsys)[0] == 0
        card = (out / "README.md").read_text()
        assert install in card and rounding in card
