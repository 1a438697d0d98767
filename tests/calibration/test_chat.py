"""A chat template's rendering of one row is bounded in the text it writes and the time it takes: every way a
template can write or build without end stops with one line naming the template and the row (exit 2, as every
row the template cannot write), and an ordinary template renders as transformers renders it."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint, make_tokenizer
from cli_helpers import run, tree
from qconvert.calibration import chat, template_bounds
from qconvert.calibration.template_bounds import TemplateBoundError

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "someone/chats"
CONVERSATIONS = [[{"role": "user", "content": "the day is long"}, {"role": "assistant", "content": "and good"}],
                 [{"role": "user", "content": "say what you know"}, {"role": "assistant", "content": "water"}]]
CHATML = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}")
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}"
WROTE = "it wrote more than 1 MiB of text for one row"
BUILT = "would pass 1 MiB, the most one row may take"
TOOK = "it took more than 1 s to render one row"


@pytest.fixture
def small_bounds(monkeypatch):
    """The bounds at 1 MiB and 1 s, so that each case stops in about a second (the same code as 64 MiB, 10 s)."""
    monkeypatch.setattr(template_bounds, "MAX_TEXT_BYTES", 2**20)
    monkeypatch.setattr(template_bounds, "MAX_SECONDS", 1.0)


def _template(folder: Path, text: str) -> chat.ChatTemplate:
    folder.mkdir(exist_ok=True)
    (folder / "chat_template.jinja").write_text(text)
    return chat.load_chat_template(folder)


@pytest.mark.parametrize("text, message", [
    (LOOPS + "some text {{ i }} {{ j }}{% endfor %}{% endfor %}", WROTE),                  # nested loops
    (LOOPS + "constant text only{% endfor %}{% endfor %}", WROTE),
    ("{% set s %}" + LOOPS + "into a variable{% endfor %}{% endfor %}{% endset %}{{ s|length }}", WROTE),
    ("{% macro m(x) %}{{ x }}{{ x }}{% endmacro %}" + LOOPS + "{{ m('into a macro') }}{% endfor %}{% endfor %}",
     WROTE),
    ("{% filter upper %}" + LOOPS + "into a filter block{% endfor %}{% endfor %}{% endfilter %}", WROTE),
    ("{% for m in messages %}{{ m.content * 10000000 }}{% endfor %}", f"a value repeated with * {BUILT}"),
    ("{{ ['x'] * 10000000 }}", f"a value repeated with * {BUILT}"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     f"a string joined with ~ {BUILT}"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     f"a value added with + {BUILT}"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     f"an integer product {BUILT}"),
    ("{{ 7 ** 100000000 }}", f"an integer power {BUILT}"),
    ("{{ 'a' | center(999999999) }}", f"the filter do_center's argument {BUILT}"),
    ("{{ ('x' * 1000) | replace('x', 'y' * 2000) }}", f"a replaced string {BUILT}"),
    ("{{ (['x' * 1000] * 2000) | join }}", f"a joined string {BUILT}"),
    ("{{ '%099999999d' % 1 }}", f"a % format width {BUILT}"),
    ("{{ '%*d' % (99999999, 1) }}", f"a % format width {BUILT}"),
    ("{{ '%099999999d' | format(1) }}", f"a format width {BUILT}"),
    ("{{ '{:>99999999}'.format(1) }}", f"a str.format width {BUILT}"),
    (LOOPS + "{% endfor %}{% endfor %}", TOOK),                                           # writes nothing
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% for d in messages %}"
     "{% endfor %}{% endfor %}{% endfor %}{% endfor %}", TOOK),                           # calls nothing either
])
def test_every_way_to_write_or_build_without_end_stops(small_bounds, tmp_path, text, message):
    template = _template(tmp_path / "model", text)
    messages = [{"role": "user", "content": "x" * 200}] * 400
    started = time.monotonic()
    with pytest.raises(TemplateBoundError) as refused:
        template.render(messages)
    assert str(refused.value) == message
    assert time.monotonic() - started < 20  # 1 s of rendering, on a loaded machine
    spin = time.monotonic() + 0.2  # nothing is left to arrive in this thread later
    while time.monotonic() < spin:
        sum(range(1000))


def test_an_ordinary_template_renders_as_transformers_renders_it(small_bounds, tmp_path):
    from transformers import AutoTokenizer

    folder = make_llama_checkpoint(tmp_path / "model", vocab=256)
    make_tokenizer(folder, vocab_size=250)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML,
                                                              "bos_token": "<s>"}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = chat.load_chat_template(folder)
    long = [{"role": "user", "content": "word " * 150_000}]  # 750 kB: inside 1 MiB
    for conversation in (*CONVERSATIONS, long):
        assert template.render(conversation) == tokenizer.apply_chat_template(conversation, tokenize=False)


@pytest.fixture
def dataset(tmp_path, monkeypatch):
    """A Hub dataset of chat rows in an offline Hub cache laid out as huggingface_hub lays it out."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = cache / ("datasets--" + REPO.replace("/", "--"))
    data = "".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 4).encode()
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    link = root / "snapshots" / COMMIT / "data" / "train.jsonl"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return f"hf://datasets/{REPO}"


@pytest.mark.parametrize("body, message", [
    ("{% for m in messages %}" + LOOPS + "{{ m.content }}{% endfor %}{% endfor %}{% endfor %}", WROTE),
    (LOOPS + "{% endfor %}{% endfor %}", TOOK),
])
def test_a_row_past_a_bound_is_one_line_naming_the_template_and_the_row(small_bounds, dataset, tmp_path, capsys,
                                                                         body, message):
    work = tmp_path / "work"
    folder = make_llama_checkpoint(work / "model", vocab=256)
    make_tokenizer(folder, vocab_size=250)
    (folder / "chat_template.jinja").write_text(body)
    before = tree(work)
    code, stdout, stderr = run(["quantize", str(folder), "-o", str(work / "out"), "--scheme", "w8a8", "--calib",
                                dataset, "--calib-samples", "2", "--calib-seqlen", "16", "--json"], capsys)
    line = (f"the model's chat template (chat_template.jinja) cannot write row 0 of split 'train' of Hub dataset "
            f"{REPO} (in data/train.jsonl): TemplateBoundError: {message}")
    assert (code, stderr) == (2, f"qconvert: error: {line}\n")
    document = json.loads(stdout)
    assert (document["exit_code"], document["error"]) == (2, line)
    assert tree(work) == before
