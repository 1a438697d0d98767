"""The example LLM's builder: the same recipe gives the same bytes; a folder is reused while its recorded sha256
hashes match, rebuilt when damaged, and a folder that holds anything else is refused. A short recipe (the example's
sizes, a few steps) keeps these quick; tests/commands/test_example_llm.py runs the full one."""

from __future__ import annotations

import json

import pytest

from cli_helpers import tree
from qconvert.examples import llama
from qconvert.formats.errors import UsageError

SHORT = {**llama.RECIPE, "steps": 3}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return llama.ensure(tmp_path_factory.mktemp("short") / "tiny", recipe=SHORT)


def test_two_builds_give_the_same_bytes(built, tmp_path):
    again = llama.ensure(tmp_path / "again", recipe=SHORT)
    assert tree(again) == tree(built)
    assert sorted(tree(built)) == sorted([*llama.FILES, llama.RECORD])
    record = json.loads((built / llama.RECORD).read_text())
    assert record["recipe"] == SHORT and record["recipe_sha256"] == llama.recipe_sha256(SHORT)
    assert record["files"] == {name: digest for name, digest in tree(built).items() if name != llama.RECORD}


def test_the_recipe_hash_covers_the_recipe_and_the_training_text(monkeypatch):
    assert llama.recipe_sha256(SHORT) != llama.recipe_sha256(llama.RECIPE)
    before = llama.recipe_sha256()
    assert llama.default_folder().name == f"tiny-llama-bytes-{before[:12]}"
    monkeypatch.setattr(llama, "built_in_text", lambda name: "other text")
    assert llama.recipe_sha256() != before


def test_the_sizes_fit_groups_of_128_and_the_evaluation_text_is_not_trained_on():
    assert llama.RECIPE["hidden"] % 128 == 0 and llama.RECIPE["intermediate"] % 128 == 0
    assert llama.RECIPE["text"] == "calibration.txt"


def test_a_checked_folder_is_reused_without_training(built, monkeypatch):
    monkeypatch.setattr(llama, "train", lambda *a, **k: pytest.fail("trained again"))
    assert llama.check(built, SHORT) is None
    assert llama.ensure(built, recipe=SHORT) == built
    assert llama.check(built) == "built from another recipe"


def test_a_damaged_folder_is_rebuilt(built, tmp_path):
    import shutil

    folder = shutil.copytree(built, tmp_path / "tiny")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))
    (folder / "tokenizer.json").unlink()
    assert llama.check(folder, SHORT) == "model.safetensors does not match its recorded sha256"
    notes = []
    assert llama.ensure(folder, recipe=SHORT, note=notes.append) == folder
    assert tree(folder) == tree(built)
    assert notes[0] == f"rebuilding {folder}: model.safetensors does not match its recorded sha256"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # nothing staged is left beside it


def test_a_folder_that_holds_anything_else_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not empty and holds no example model"):
        llama.ensure(tmp_path / "mine", recipe=SHORT)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a folder"):
        llama.ensure(tmp_path / "file", recipe=SHORT)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_the_tokenizer_is_byte_level_with_bos(built):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(built / "tokenizer.json"))
    text = "Añ river\n"
    ids = tokenizer.encode(text).ids
    assert ids == [llama.BOS, *text.encode("utf-8")]
    assert tokenizer.decode(ids) == text
    assert json.loads((built / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
