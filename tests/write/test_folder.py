"""`-o` never destroys anything: not the input, not the current folder, not a folder qconvert did not write."""

import shutil

import pytest

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("safety") / "model")


@pytest.fixture
def parent(model_source, tmp_path):
    """tmp/parent holding the model and an unrelated file of the user's."""
    parent = tmp_path / "parent"
    shutil.copytree(model_source, parent / "model")
    (parent / "notes.txt").write_text("the user's own file")
    return parent


@pytest.mark.parametrize("out,cwd,words", [
    ("{model}", None, "is the input model's folder"),
    ("{parent}", None, "holds the input model"),
    ("{model}/sub", None, "lies inside the input model's folder"),
    (".", "{parent}", "is the current folder"),
    ("{parent}", "{parent}/model", "is the current folder or holds it"),
    ("", None, "is empty"),
], ids=["input", "holds-input", "inside-input", "cwd", "holds-cwd", "empty"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_an_out_that_would_destroy_the_input_or_the_cwd_is_refused_with_exit_2(parent, capsys, monkeypatch, out,
                                                                                 cwd, words, overwrite):
    root = parent.parent
    before = tree(root)
    paths = {"model": str(parent / "model"), "parent": str(parent)}
    if cwd is not None:
        monkeypatch.chdir(cwd.format(**paths))
    argv = ["quantize", paths["model"], "-o", out.format(**paths)] + (["--overwrite"] if overwrite else [])
    exit_code, _, stderr = run(argv, capsys)
    assert exit_code == 2
    assert len(stderr.strip().splitlines()) == 1 and words in stderr, stderr
    assert tree(root) == before


def test_overwrite_refuses_a_folder_qconvert_did_not_write(parent, capsys):
    out = parent.parent / "theirs"
    out.mkdir()
    (out / "data.csv").write_text("1,2,3")
    before = tree(parent.parent)
    exit_code, _, stderr = run(["quantize", str(parent / "model"), "-o", str(out), "--overwrite"], capsys)
    assert exit_code == 8 and stderr == (
        f"qconvert: error: {out} is not a folder qconvert wrote: data.csv is not listed in a qconvert.json (there "
        f"is none); {REPLACES_ONLY}\n")
    assert tree(parent.parent) == before


REPLACES_ONLY = ("--overwrite replaces only an empty folder or one whose qconvert.json lists every file in it: "
                 "choose another -o")


@pytest.fixture(scope="module")
def converted(model_source, tmp_path_factory):
    from qconvert.convert import convert
    from qconvert.options import ConvertOptions

    out = tmp_path_factory.mktemp("converted") / "out"
    convert(str(model_source), out, ConvertOptions())
    return out


@pytest.mark.parametrize("change,foreign,why", [
    (lambda out: (out / "notes.txt").write_text("mine"), "notes.txt", "is not listed in its qconvert.json"),
    (lambda out: ((out / "runs").mkdir(), (out / "runs" / "log.txt").write_text("mine")), "runs/log.txt",
     "is not listed in its qconvert.json"),
    (lambda out: (out / "qconvert.json").write_text("{not json"), "qconvert.json",
     "is not a valid conversion record (unreadable)"),
    (lambda out: (out / "qconvert.json").write_text('{"scheme": "int8"}'), "qconvert.json",
     "is not a valid conversion record (no files map)"),
    (lambda out: (out / "zz-link").symlink_to(out / "config.json"), "zz-link", "is not a regular file"),
], ids=["extra-file", "extra-in-subfolder", "unreadable-record", "record-without-files", "link"])
def test_overwrite_refuses_a_qconvert_folder_holding_anything_its_record_does_not_list(model_source, converted,
                                                                                       tmp_path, capsys, change,
                                                                                       foreign, why):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    change(out)
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(model_source), "-o", str(out), "--overwrite", "-q"], capsys)
    assert (exit_code, stderr) == (
        8, f"qconvert: error: {out} is not a folder qconvert wrote: {foreign} {why}; {REPLACES_ONLY}\n")
    assert tree(tmp_path) == before


def test_overwrite_replaces_an_empty_folder_and_its_own_output(parent, capsys):
    out = parent.parent / "out"
    out.mkdir()
    before = {k: v for k, v in tree(parent.parent).items() if not k.startswith("out")}
    assert run(["quantize", str(parent / "model"), "-o", str(out), "--overwrite", "-q"], capsys)[0] == 0
    assert run(["quantize", str(parent / "model"), "-o", str(out), "--overwrite", "-q", "--scheme", "nf4"],
               capsys)[0] == 0
    after = tree(parent.parent)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before
    assert '"scheme": "nf4"' in (out / "qconvert.json").read_text()
    assert not [p for p in parent.parent.iterdir() if p.name.startswith(".out.")]


def test_an_out_that_is_a_file_gets_a_hint_that_works(parent, capsys):
    out = parent.parent / "out.txt"
    out.write_text("keep me")
    for extra in ([], ["--overwrite"]):
        exit_code, _, stderr = run(["quantize", str(parent / "model"), "-o", str(out), *extra], capsys)
        assert exit_code == 8 and "--overwrite" not in stderr and "is not a folder" in stderr
        assert out.read_text() == "keep me"


def test_a_relative_out_beside_the_input_is_fine(parent, capsys, monkeypatch):
    monkeypatch.chdir(parent)
    assert run(["quantize", "model", "-o", "model-int8", "-q"], capsys)[0] == 0
    assert (parent / "model-int8" / "qconvert.json").is_file() and (parent / "notes.txt").exists()
