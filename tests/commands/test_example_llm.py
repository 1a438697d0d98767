"""`qconvert example-model --llm` end to end: the causal LM it builds (once per session, under a temporary cache)
is printed like the encoder's folder and reused; transformers loads it and computes qconvert's own logits, and
generates; it converts and passes verify (KL, top-1, perplexity), lm_head included; the README's LLM commands run
as written, offline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_helpers import quantize_quietly, run, tree
from qconvert.examples import llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache home ($XDG_CACHE_HOME) holding the built example, where the command looks for it."""
    home = tmp_path_factory.mktemp("cache-home")
    llama.ensure(home / "qconvert" / llama.default_folder().name)
    return home


@pytest.fixture(scope="module")
def model(cache):
    return cache / "qconvert" / llama.default_folder().name


def test_the_command_prints_the_cached_folder_and_reuses_it(cache, model, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(llama, "train", lambda *a, **k: pytest.fail("trained again"))
    before = tree(model)
    code, stdout, stderr = run(["example-model", "--llm"], capsys)
    assert code == 0 and stdout == f"{model}\n" and stderr == ""
    assert tree(model) == before and llama.check(model) is None
    size = (model / "model.safetensors").stat().st_size
    assert 2_000_000 < size < 8_000_000  # a few MB
    record = json.loads((model / llama.RECORD).read_text())
    assert record["final_loss_nats_per_byte"] < 2.5  # trained: a uniform guess over 320 ids is 5.8


def test_out_gives_the_folder_and_is_only_for_llm(model, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(llama, "train", lambda *a, **k: pytest.fail("trained again"))
    shutil.copytree(model, tmp_path / "tiny")
    code, stdout, _ = run(["example-model", "--llm", "--out", str(tmp_path / "tiny")], capsys)
    assert code == 0 and stdout == f"{tmp_path / 'tiny'}\n"
    code, stdout, stderr = run(["example-model", "--out", str(tmp_path / "tiny")], capsys)
    assert code == 2 and stdout == "" and "--out is for --llm" in stderr


def _evaluation_batch(tokenizer, texts, seq_len):
    encoded = tokenizer(texts, return_tensors="np", padding="max_length", truncation=True, max_length=seq_len)
    return encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)


def test_transformers_computes_qconvert_s_logits_and_generates(model):
    import torch
    import transformers

    from qconvert.calibration.layers import forward_layerwise
    from qconvert.formats.jsonfile import read_config
    from qconvert.models import build
    from safetensors.numpy import load_file

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    prose = llama.built_in_text("evaluation.txt")
    ids, mask = _evaluation_batch(tokenizer, [prose[:200], prose[1000:1060]], 96)  # the second one padded
    assert (ids[:, 0] == llama.BOS).all() and mask[0].all() and mask[1].sum() == 61
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(ids, dtype=torch.long),
                         attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()
    got = np.asarray(forward_layerwise(build(read_config(model)), load_file(str(model / "model.safetensors")),
                                       ids, mask))
    valid = mask.astype(bool)
    assert got.shape == want.shape == (2, 96, 320)
    assert np.abs(got[valid] - want[valid]).max() < 1e-3 * np.abs(want[valid]).max()
    assert (got[valid].argmax(-1) == want[valid].argmax(-1)).all()

    inputs = tokenizer("The river", return_tensors="pt")
    out = reference.generate(**inputs, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith("The river") and len(text) > len("The river") + 10


@pytest.mark.parametrize("scheme,extra", [("int8", ()), ("w8a8", ()), ("int8", ("--include", "lm_head"))],
                         ids=["int8", "w8a8", "int8-lm_head"])
def test_it_converts_and_passes_verify_with_kl_top1_and_perplexity(model, tmp_path, capsys, scheme, extra):
    out = quantize_quietly(model, tmp_path / "out", "--scheme", scheme, *extra)
    code, stdout, stderr = run(["verify", str(out), "--json"], capsys)
    document = json.loads(stdout)
    assert code == 0 and document["passed"] is True, stderr
    whole = document["model"]
    assert whole["kind"] == "causal_lm" and whole["passed"] is True
    assert {c["name"] for c in whole["checks"]} == {"mean_kl", "top1_agreement", "perplexity_ratio"}
    assert whole["mean_kl"] < 1e-3 and whole["top1_agreement"] > 0.95 and 1 < whole["perplexity_float"] < 20
    if scheme == "w8a8":  # calibrated: evaluated on text held out from the calibration text
        assert document["evaluation"]["held_out"]["disjoint"] is True
    linears = {entry["name"] for entry in document["layers"]}
    assert ("lm_head" in linears) == bool(extra)


def test_the_built_in_texts_share_no_run_of_16_bytes():
    """Under the example's byte tokens a run of 16 tokens is 16 bytes: verify's held-out check (no run of 16 tokens
    in common) passes for every tokenizer whose tokens are at least a byte."""
    calibration = llama.built_in_text("calibration.txt").encode("utf-8")
    evaluation = llama.built_in_text("evaluation.txt").encode("utf-8")
    runs = {calibration[i:i + 16] for i in range(len(calibration) - 15)}
    assert not [evaluation[i:i + 16] for i in range(len(evaluation) - 15) if evaluation[i:i + 16] in runs]


def readme_llm_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Setup and first run\n"):]
    section = section[:section.index("\n## ", 3)]
    (block,) = [b for b in re.findall(r"\n\n((?:    \S.*\n)+)", section) if "example-model --llm" in b]
    return [line.strip() for line in block.splitlines()]


def test_the_readme_llm_commands_work_offline_as_written(cache, tmp_path):
    commands = readme_llm_commands()
    assert [c.split()[:2] for c in commands] == [["qconvert", "quantize"], ["qconvert", "verify"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home"),
           "XDG_CACHE_HOME": str(cache), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = [subprocess.run(["bash", "-c", f"set -euo pipefail; {c}"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600, check=False) for c in commands]
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    verdict = done[-1].stdout.strip().splitlines()[-1]
    assert re.match(r"PASS int4 tiny-int4: .* KL [\d.e-]+, top-1 [\d.]+%, ppl x[\d.]+$", verdict), verdict
