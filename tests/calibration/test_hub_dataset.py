"""--calib hf://datasets/OWNER/NAME: a whole Hub dataset read from a Hub cache built here (HF_HUB_OFFLINE=1), its
split found as the datasets library finds it, one column read lazily, chat rows written with the model's own chat
template as transformers writes them, and every refusal one line with its exit code."""

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer

from cli_helpers import run
from qconvert.calibration import chat
from qconvert.calibration.data import load_calibration
from qconvert.calibration.hub_dataset import DatasetSelection
from qconvert.formats.errors import HubUnavailableError, InvalidCheckpointError, ModelNotFoundError, UsageError

COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
REPO = "someone/corpus"
ADDRESS = f"hf://datasets/{REPO}"
# ChatML, after Qwen's, with the BOS a Llama-style template writes first.
CHATML = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the people of this world can make a long day good and use their time to say what they know about "
         "water and sound").split()


def sentences(count: int, start: int = 0, words: int = 12) -> list[str]:
    """`count` distinct texts of known words (each text a different rotation, so no two windows are alike)."""
    return [" ".join(WORDS[(start + k + j) % len(WORDS)] for j in range(words)) for k in range(count)]


def _tokenizer_folder(folder: Path, template: str | None) -> Path:
    """The tiny word-level tokenizer (ids below the model's 256 rows) with ChatML's markers and <s> as specials."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(folder, vocab_size=250)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("datasets") / "model", vocab=256)
    _tokenizer_folder(folder, CHATML)
    return folder, json.loads((folder / "config.json").read_text())


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """publish(files, repo, commit): lay a dataset out in a Hub cache as huggingface_hub caches it (blobs named by
    sha256, snapshots/COMMIT/ links to them, refs/main), offline."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def publish(files: dict[str, bytes], repo: str = REPO, commit: str = COMMIT) -> Path:
        root = cache / ("datasets--" + repo.replace("/", "--"))
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "refs").mkdir(exist_ok=True)
        for name, data in files.items():
            blob = root / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            link = root / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        (root / "refs" / "main").write_text(commit)
        return root / "snapshots" / commit

    return publish


def parquet(**columns) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, row_group_size=3)  # several row groups: read a batch at a time
    return sink.getvalue()


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def reference_windows(folder: Path, texts: list[str], samples: int, seqlen: int) -> np.ndarray:
    """The tokenizers library's own encoding of each text, concatenated, cut into windows after one <s>."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    stream = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids]
    body = seqlen - 1
    bos = tokenizer.token_to_id("<s>")
    return np.asarray([[bos] + stream[k * body:(k + 1) * body] for k in range(samples)], np.int32)


def calibrate(model, samples=2, seqlen=32, **selection):
    folder, config = model
    return load_calibration(ADDRESS, folder, config, samples=samples, seqlen=seqlen,
                            dataset=DatasetSelection(**selection))


def test_the_train_shards_are_read_in_order_and_only_as_far_as_the_windows_need(model, hub):
    first, second, test = sentences(4), sentences(40, start=5), sentences(40, start=9)
    files = {"README.md": b"---\nlicense: mit\n---\n# corpus\n",
             "data/train-00000-of-00002.parquet": parquet(text=first, id=list(range(4))),
             "data/train-00001-of-00002.parquet": parquet(text=second, id=list(range(40))),
             "data/test-00000-of-00001.parquet": parquet(text=test, id=list(range(40)))}
    hub(files)
    data = calibrate(model)
    assert np.array_equal(data.input_ids, reference_windows(model[0], first + second, 2, 32))
    record = data.record()["dataset"]
    assert record == {"repo": REPO, "revision": COMMIT, "config": "default", "split": "train", "column": "text",
                      "files": [{"path": p, "sha256": hashlib.sha256(files[p]).hexdigest()}
                                for p in ("data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet")],
                      "chat_template": None}
    one = calibrate(model, samples=1, seqlen=16)  # 15 tokens: the first shard's 48 suffice
    assert [f["path"] for f in one.record()["dataset"]["files"]] == ["data/train-00000-of-00002.parquet"]
    held = calibrate(model, split="test")
    assert np.array_equal(held.input_ids, reference_windows(model[0], test, 2, 32))
    assert "split test" in held.description and held.record()["source"] == ADDRESS


LAYOUTS = {  # files of a split, as the datasets library finds them by name, and their reader
    "split named files, JSON Lines": {"train.jsonl": "jsonl", "test.jsonl": "jsonl"},
    "a data folder of JSON arrays": {"data/train.json": "json", "data/validation.json": "json",
                                     "data/test.json": "json"},
    "the parquet export's folders": {"default/train/0000.parquet": "parquet", "default/test/0000.parquet": "parquet"},
    "split folders of CSV": {"train/part.csv": "csv", "test/part.csv": "csv"},
    "keywords inside names, text lines gzipped": {"corpus_train_1.txt.gz": "txt", "corpus_test_1.txt.gz": "txt"},
}


def _encoded(kind: str, texts: list[str]) -> bytes:
    import gzip

    if kind == "jsonl":
        return jsonl([{"text": t, "n": k} for k, t in enumerate(texts)])
    if kind == "json":
        return json.dumps([{"n": k, "text": t} for k, t in enumerate(texts)], indent=1).encode()
    if kind == "parquet":
        return parquet(text=texts)
    if kind == "csv":
        return ("n,text\n" + "".join(f'{k},"{t}"\n' for k, t in enumerate(texts))).encode()
    return gzip.compress("".join(t + "\n" for t in texts).encode(), mtime=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_split_is_found_as_the_datasets_library_finds_it(model, hub, layout):
    texts = {name: sentences(12, start=k * 3) for k, name in enumerate(LAYOUTS[layout])}
    hub({name: _encoded(kind, texts[name]) for name, kind in LAYOUTS[layout].items()} | {"README.md": b"# x\n"})
    for name in LAYOUTS[layout]:
        split = next(s for s in ("train", "validation", "test") if s in name)
        data = calibrate(model, split=split)
        assert np.array_equal(data.input_ids, reference_windows(model[0], texts[name], 2, 32)), (layout, split)
        assert [f["path"] for f in data.record()["dataset"]["files"]] == [name]


CARD = b"""---
license: mit
configs:
- config_name: default
  data_files:
  - split: train
    path: wiki/train-*
- config_name: other
  data_files: other/*.jsonl
---
# corpus
"""


def test_the_readme_configs_name_the_files_of_each_split(model, hub):
    wiki, other, plain = sentences(12, start=2), sentences(12, start=7), sentences(12, start=11)
    hub({"README.md": CARD,
         "wiki/train-0.jsonl": jsonl([{"text": t} for t in wiki]),
         "other/a.jsonl": jsonl([{"text": t} for t in other]),
         "data/train-00000-of-00001.parquet": parquet(text=plain)})  # what names alone would choose
    assert np.array_equal(calibrate(model).input_ids, reference_windows(model[0], wiki, 2, 32))
    data = calibrate(model, config="other")  # a bare pattern is the train split
    assert np.array_equal(data.input_ids, reference_windows(model[0], other, 2, 32))
    assert data.record()["dataset"]["config"] == "other" and "config other" in data.description
    with pytest.raises(UsageError, match=r"--calib-config missing: the dataset has no such config; its configs: "
                                         r"default, other$"):
        calibrate(model, config="missing")


def test_the_column_is_text_else_messages_else_refused_naming_the_columns(model, hub):
    texts = sentences(12)
    hub({"data/train.jsonl": jsonl([{"content": t, "id": k} for k, t in enumerate(texts)])})
    with pytest.raises(UsageError, match=r"no 'text', 'messages' or 'conversations' column; its columns: content, "
                                         r"id \(pass one to --calib-column\)"):
        calibrate(model)
    data = calibrate(model, column="content")
    assert np.array_equal(data.input_ids, reference_windows(model[0], texts, 2, 32))
    with pytest.raises(UsageError, match="has no column 'body'; its columns: content, id"):
        calibrate(model, column="body")


CONVERSATIONS = [
    [{"role": "system", "content": "say what you know"},
     {"role": "user", "content": f"what about {w} water"},
     {"role": "assistant", "content": f"the {w} is good to use and make sound"}]
    for w in ("world", "time", "day", "people", "sound", "long")
]


def test_chat_rows_are_written_as_transformers_writes_them_and_the_windows_hold_one_bos(model, hub):
    from transformers import AutoTokenizer

    folder, _ = model
    rendered = [AutoTokenizer.from_pretrained(folder).apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    template = chat.load_chat_template(folder)
    assert [template.render(chat.conversation(c, "row")) for c in CONVERSATIONS] == rendered
    assert all(text.startswith("<s><|im_start|>system\n") for text in rendered)
    # The id column is first, "text" is absent: "messages" is chosen, and each conversation loses the <s> that
    # starts every window already.
    hub({"data/train-00000-of-00001.parquet": parquet(id=list(range(6)), messages=CONVERSATIONS)})
    data = calibrate(model, samples=2, seqlen=48)
    assert np.array_equal(data.input_ids, reference_windows(folder, [t[len("<s>"):] for t in rendered], 2, 48))
    assert int((data.input_ids == 1).sum()) == 2  # one <s> a window, at its start
    record = data.record()["dataset"]
    assert record["column"] == "messages" and record["chat_template"] == {
        "file": "tokenizer_config.json", "sha256": hashlib.sha256(CHATML.encode()).hexdigest(),
        "dropped_prefix": "<s>"}
    assert "written with the model's chat template" in data.description


def test_a_template_without_a_bos_keeps_every_token_it_writes(hub, tmp_path):
    from transformers import AutoTokenizer

    folder = make_llama_checkpoint(tmp_path / "qwen-like", vocab=256)
    _tokenizer_folder(folder, CHATML.removeprefix("{{ bos_token }}"))
    rendered = [AutoTokenizer.from_pretrained(folder).apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    hub({"data/train.jsonl": jsonl([{"conversations": c} for c in CONVERSATIONS])})
    data = load_calibration(ADDRESS, folder, json.loads((folder / "config.json").read_text()), samples=2, seqlen=48)
    assert np.array_equal(data.input_ids, reference_windows(folder, rendered, 2, 48))
    assert data.record()["dataset"]["column"] == "conversations"
    assert data.record()["dataset"]["chat_template"]["dropped_prefix"] is None


def test_a_conversation_is_read_in_its_common_shapes():
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}], "name": None}]
    assert chat.conversation(parts, "row 0") == [{"role": "user", "content": "one\ntwo"}]
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    assert chat.conversation(sharegpt, "row 0") == [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"}]
    with pytest.raises(UsageError, match="row 3: message 0 is from 'robot'"):
        chat.conversation([{"from": "robot", "value": "x"}], "row 3")


def test_the_template_file_and_named_templates_are_found_as_transformers_finds_them(tmp_path):
    from transformers import AutoTokenizer

    listed = _tokenizer_folder(tmp_path / "listed", [{"name": "tool_use", "template": "TOOLS"},
                                                     {"name": "default", "template": "D{{ eos_token }}"}])
    assert chat.load_chat_template(listed).render([]) == "D</s>"
    filed = _tokenizer_folder(tmp_path / "filed", CHATML)
    (filed / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content | upper }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}]
    expected = AutoTokenizer.from_pretrained(filed).apply_chat_template(messages, tokenize=False)
    assert chat.load_chat_template(filed).render(messages) == expected == "[HI]"
    assert chat.load_chat_template(filed).record()["file"] == "chat_template.jinja"
    broken = _tokenizer_folder(tmp_path / "broken", "{% for m in messages %}")
    with pytest.raises(InvalidCheckpointError, match="not a valid Jinja template"):
        chat.load_chat_template(broken)


@pytest.mark.parametrize("template,error,message", [
    ("{{ messages.append(1) }}", InvalidCheckpointError,
     r"the model's chat template \(tokenizer_config.json\) did what jinja2's sandbox forbids \(SecurityError: "
     r"access to attribute 'append' of 'list' object is unsafe.\); fix the template"),
    ("{% set ns = namespace(_hidden=1) %}", InvalidCheckpointError, "a namespace attribute may not start with '_'"),
    ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}",
     UsageError, r"the model's chat template \(tokenizer_config.json\) cannot write row 0 of split 'train' of Hub "
                 r"dataset someone/corpus \(in data/train.jsonl\): TemplateError: Conversations must start with the "
                 r"user"),
])
def test_a_template_runs_in_the_sandbox_and_its_refusals_name_the_row(hub, tmp_path, template, error, message):
    folder = make_llama_checkpoint(tmp_path / "model", vocab=256)
    _tokenizer_folder(folder, template)
    hub({"data/train.jsonl": jsonl([{"messages": c} for c in CONVERSATIONS])})
    with pytest.raises(error, match=message):
        load_calibration(ADDRESS, folder, json.loads((folder / "config.json").read_text()), samples=2, seqlen=32)


def test_chat_rows_for_a_model_without_a_chat_template_are_refused(hub, tmp_path):
    folder = make_llama_checkpoint(tmp_path / "plain", vocab=256)
    _tokenizer_folder(folder, None)
    hub({"data/train.jsonl": jsonl([{"messages": c} for c in CONVERSATIONS])})
    with pytest.raises(UsageError, match="column 'messages' of split 'train' of Hub dataset someone/corpus holds "
                                         "conversations, and the model has no chat template"):
        load_calibration(ADDRESS, folder, json.loads((folder / "config.json").read_text()), samples=2, seqlen=32)


@pytest.mark.parametrize("files,selection,error,message", [
    ({"train.jsonl": b"", "test.jsonl": b""}, {"split": "dev"}, UsageError,
     r"has no split 'dev' in the cached snapshot a1b2c3d4e5f6; its splits: train, test \(pass one to --calib-split\)"),
    ({"data/train-00000-of-00001.parquet": b"PAR1 not really"}, {}, UsageError,
     r"data/train-00000-of-00001.parquet of Hub dataset someone/corpus cannot be read \(ArrowInvalid"),
    ({"data/train.jsonl": jsonl([{"text": "the day"}, {"text": 7}])}, {}, UsageError,
     r"row 1 of split 'train' of Hub dataset someone/corpus \(in data/train.jsonl\): column 'text' holds int"),
    ({"data/train.parquet": parquet(text=["the day", None])}, {}, UsageError,
     r"row 1 of split 'train' .*: column 'text' holds null"),
    ({"data/train-0.arrow": b"x", "data/train-1.arrow": b"y", "README.md": b"# x"}, {}, UsageError,
     r"split 'train' of the dataset has no file qconvert reads in the cached snapshot a1b2c3d4e5f6 \(files: 2 "
     r"\.arrow\)"),
    ({"train.jsonl.zst": b"x"}, {}, UsageError, r"train.jsonl.zst of Hub dataset someone/corpus is compressed as "
                                                r"\.zst; qconvert reads \.gz, \.bz2 and \.xz ones"),
    ({"README.md": b"---\nconfigs:\n- config_name: a\n- config_name: b\n---\n", "a.jsonl": b""}, {}, UsageError,
     r"the dataset has configs a, b and no default; pass --calib-config NAME"),
])
def test_bad_datasets_are_refused_naming_what_was_found(model, hub, files, selection, error, message):
    hub(files)
    with pytest.raises(error, match=message):
        calibrate(model, **selection)


def test_a_dataset_not_cached_offline_is_exit_4_and_flags_without_a_dataset_exit_2(model, hub):
    with pytest.raises(HubUnavailableError, match=r"HF_HUB_OFFLINE is set\) and dataset someone/corpus is not in "
                                                  r"the cache .*hf download someone/corpus --repo-type dataset"):
        calibrate(model)
    with pytest.raises(UsageError, match=r"--calib-split chooses from a whole Hub dataset"):
        load_calibration("builtin", model[0], model[1], dataset=DatasetSelection(split="test"))


class _Info:
    sha = COMMIT

    def __init__(self, paths):
        self.siblings = [type("Sibling", (), {"rfilename": p})() for p in paths]


def test_online_only_the_readme_and_the_files_read_are_downloaded(model, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from qconvert.source import hub as source_hub

    source = tmp_path / "remote"
    files = {"README.md": b"# x\n", "data/train-00000-of-00002.parquet": parquet(text=sentences(40)),
             "data/train-00001-of-00002.parquet": parquet(text=sentences(40, start=3)),
             "data/test-00000-of-00001.parquet": parquet(text=sentences(40, start=5))}
    for name, data in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    downloads = []

    def download(repo_id, filename, **kwargs):
        assert (repo_id, kwargs["repo_type"], kwargs["revision"], kwargs["local_files_only"]) == (
            REPO, "dataset", COMMIT, False)
        downloads.append(filename)
        return str(source / filename)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(source_hub, "hub_unreachable_reason", lambda *a, **k: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, repo, revision=None: _Info(files))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    data = calibrate(model)
    assert downloads == ["README.md", "data/train-00000-of-00002.parquet"]
    assert np.array_equal(data.input_ids, reference_windows(model[0], sentences(40), 2, 32))

    import httpx2

    response = httpx2.Response(404, request=httpx2.Request("GET", f"https://huggingface.co/api/datasets/{REPO}"))
    for raised, expected, message in [
            (hub_errors.RepositoryNotFoundError("404", response=response), ModelNotFoundError,
             "Hub dataset someone/corpus not found"),
            (hub_errors.RevisionNotFoundError("404", response=response), ModelNotFoundError, "has no revision"),
            (httpx2.ConnectError("connection refused"), HubUnavailableError, "connection refused")]:
        def failing(self, repo, revision=None, _raised=raised):
            raise _raised

        monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", failing)
        with pytest.raises(expected, match=message):
            calibrate(model)


def test_the_commands_take_the_flags_and_verify_reads_the_recorded_split_again(model, hub, tmp_path, capsys):
    from qconvert.verify.held_out import calibration_windows

    train, test = sentences(30), sentences(30, start=6)
    hub({"train.jsonl": jsonl([{"text": t} for t in train]), "test.jsonl": jsonl([{"text": t} for t in test])})
    folder, config = model
    assert run(["calibrate", str(folder), "-o", str(tmp_path / "stats.safetensors"), "--calib", ADDRESS,
                "--calib-split", "dev"], capsys) == (
        2, "", f"qconvert: error: --calib {ADDRESS}: the dataset has no split 'dev' in the cached snapshot "
               "a1b2c3d4e5f6; its splits: train, test (pass one to --calib-split)\n")
    assert run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8", "--calib-column",
                "text"], capsys)[0::2] == (
        2, "qconvert: error: --calib-column chooses from a whole Hub dataset (--calib hf://datasets/OWNER/NAME), "
           "not from --calib builtin\n")
    code, _, stderr = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8", "-q",
                           "--calib", ADDRESS, "--calib-split", "test", "--calib-samples", "2",
                           "--calib-seqlen", "32"], capsys)
    assert (code, stderr) == (0, "")
    recorded = json.loads((tmp_path / "out" / "qconvert.json").read_text())["calibration"]
    assert recorded["dataset"]["split"] == "test" and recorded["dataset"]["files"] == [
        {"path": "test.jsonl", "sha256": hashlib.sha256(jsonl([{"text": t} for t in test])).hexdigest()}]
    expected = reference_windows(folder, test, 2, 32)
    assert np.array_equal(calibration_windows(recorded, folder, config), expected)


def test_an_unreachable_hub_reads_the_cached_snapshot(model, hub, monkeypatch):
    from qconvert.source import hub as source_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(source_hub, "hub_unreachable_reason", lambda *a, **k: " (127.0.0.1:9: Connection refused)")
    with pytest.raises(HubUnavailableError, match=r"^the Hub cannot be reached \(127.0.0.1:9: Connection refused\) "
                                                  "and dataset someone/corpus is not in the cache"):
        calibrate(model)
    hub({"train.jsonl": jsonl([{"text": t} for t in sentences(30)])})
    assert np.array_equal(calibrate(model).input_ids, reference_windows(model[0], sentences(30), 2, 32))
