"""The servers table's BERT rows (qconvert/schemes/servers.py), measured on the bundled example: a folder of
all-MiniLM-L6-v2 in every scheme loads in transformers through its own model card's snippet and computes what the
float model computes, within the scheme's rounding; `qconvert inspect` then says "transformers yes", and the card's
"loads in" row says what inspect says."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from checkpoints import minilm_path
from cli_helpers import run, servers_cell
from qconvert.calibration.data import load_calibration
from qconvert.schemes import NAMES, SCHEMES

FOLDER = "path/to/this/folder"
CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]
# Each scheme with the flags that change where it loads (servers.scheme_key), round-to-nearest where that is a flag.
CASES = {"int8": [], "int4": ["--no-awq", "--no-gptq"], "w8a8": CALIB, "w8a8-static": [*CALIB, "--act", "static"],
         "fp8": [], "nf4": [], "int4-asym": ["--no-awq", "--no-gptq"], "w4a8-fp8": ["--no-awq", "--no-gptq"],
         "nvfp4a16": ["--no-gptq"], "mxfp4a16": ["--no-gptq"], "nvfp4": CALIB}


def pooled(model, ids) -> np.ndarray:
    """The mean of the last hidden states over each sequence's tokens (sentence-transformers' pooling)."""
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).last_hidden_state.double().numpy().mean(axis=1)


def card_model(out):
    """The model the card's transformers snippet loads (its import and from_pretrained lines, run as written)."""
    card = (out / "README.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)[-1].replace(FOLDER, str(out))
    assert "AutoModel.from_pretrained" in snippet
    namespace: dict = {}
    code = "\n".join(line for line in snippet.splitlines() if line.startswith(("import ", "from ", "model = ")))
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the card's own code, as a reader runs it
    return namespace["model"].eval()


def test_every_scheme_has_a_case():
    assert {case.split("-static")[0] for case in CASES} == set(NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_example_loads_in_transformers_as_its_card_and_inspect_say(case, tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    if case == "nf4":
        pytest.importorskip("bitsandbytes")
    scheme = case.split("-static")[0]
    source = minilm_path()  # all-MiniLM-L6-v2, the bundled example: the folder a new user converts first
    out = tmp_path / case
    code, _, err = run(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *CASES[case]], capsys)
    assert code == 0, err
    config = json.loads((source / "config.json").read_text())
    ids = load_calibration("held-out", source, config, samples=2, seqlen=32).input_ids  # verify's evaluation text
    expected = pooled(transformers.BertModel.from_pretrained(str(source)).eval(), ids)
    got = pooled(card_model(out), ids)
    cosine = (got * expected).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(expected, axis=-1)
    # The bar verify holds qconvert's own kernels to, on the same held-out text.
    thresholds = SCHEMES[scheme].static_thresholds if case.endswith("-static") else SCHEMES[scheme].thresholds
    assert cosine.min() >= thresholds.min_pooled_cosine, (case, cosine)
    assert not np.allclose(got, expected, rtol=0, atol=1e-6)  # the quantized weights were read, not float ones
    capsys.readouterr()  # what transformers printed while loading
    assert servers_cell(out, capsys) == "yes"
    card = (out / "README.md").read_text()
    [row] = [line for line in card.splitlines() if line.startswith("| loads in |")]
    code, report, _ = run(["inspect", str(out)], capsys)
    assert code == 0
    [shown] = [line for line in report.splitlines() if line.startswith("loads in: ")]
    assert shown.removeprefix("loads in: ") in row and "transformers yes" in row
