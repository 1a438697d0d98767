"""verify holds a smoothed folder to the exact scales qconvert.json records: the norms are the reference's
divided by them bit for bit, an edit to either side fails integrity, and a record without them (written
before record format 2) gets one line asking for a new conversion."""

import base64
import hashlib
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from safetensors.numpy import load_file, save_file

from cli_helpers import quantize_quietly, run as run_cli

TINY = dict(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=128)
NORM = "model.layers.0.input_layernorm"


def verify(folder, capsys):
    code, out, err = run_cli(["verify", str(folder), "--quick", "--backend", "xla", "--json", "-"], capsys)
    return code, (json.loads(out) if out.strip() else None), err


def scales(record, source, key="source_scales"):
    entry = record["smoothing"]["scales"][source]
    return np.frombuffer(base64.b64decode(entry.get(key, entry["source_scales"])), "<f4")


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoothed")
    source = make_llama_checkpoint(root / "src", dtype="bfloat16", outlier_channels=(3, 17), **TINY)
    out = root / "w8a8"
    quantize_quietly(source, out, "--scheme", "w8a8", "--calib", "random", "--calib-samples", "4",
                     "--calib-seqlen", "32")
    return source, out


@pytest.fixture
def copy(smoothed, tmp_path):
    """A copy beside the conversion: qconvert.json finds its source from there as from the original."""
    target = shutil.copytree(smoothed[1], smoothed[1].parent / f"copy-{tmp_path.name}")
    yield target
    shutil.rmtree(target, ignore_errors=True)


def test_the_norms_are_the_reference_divided_by_the_recorded_scales_and_verify_passes(smoothed, capsys):
    source, out = smoothed
    record = json.loads((out / "qconvert.json").read_text())
    assert record["format_version"] == 2
    ref, conv = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for norm in (NORM, "model.layers.0.post_attention_layernorm"):
        s = scales(record, norm)
        assert np.abs(s - 1).max() > 1e-3  # really smoothed
        want = (ref[f"{norm}.weight"].astype(np.float32) / s).astype(ml_dtypes.bfloat16)
        assert conv[f"{norm}.weight"].tobytes() == want.tobytes()
    # o_proj's input scales: v_proj's per KV-head channel, repeated for the query heads of its group.
    v = scales(record, "model.layers.0.self_attn.v_proj")
    o = scales(record, "model.layers.0.self_attn.v_proj", "input_scales")
    head_dim, repeat = TINY["hidden"] // TINY["heads"], TINY["heads"] // TINY["kv_heads"]
    channel = np.arange(TINY["hidden"])
    assert o.tolist() == v[((channel // head_dim) // repeat) * head_dim + channel % head_dim].tolist()
    code, report, err = verify(out, capsys)
    assert code == 0 and report["passed"], err


def rehash(folder):
    record = json.loads((folder / "qconvert.json").read_text())
    record["files"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in record["files"]}
    (folder / "qconvert.json").write_text(json.dumps(record))


def test_a_norm_edited_after_conversion_fails_integrity_naming_it(copy, capsys):
    tensors = load_file(str(copy / "model.safetensors"))
    tensors[f"{NORM}.weight"] = (tensors[f"{NORM}.weight"].astype(np.float32) * 1.01).astype(ml_dtypes.bfloat16)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    rehash(copy)  # as a converter that wrote the wrong norm would have
    code, report, _ = verify(copy, capsys)
    assert code == 1 and not report["integrity"]["passed"]
    assert any(p.startswith(f"{NORM}.weight: ") and "smoothing scales qconvert.json records" in p
               for p in report["integrity"]["problems"]), report["integrity"]["problems"]


def test_a_recorded_scale_that_is_not_the_folded_one_fails_integrity(copy, capsys):
    record = json.loads((copy / "qconvert.json").read_text())
    s = scales(record, NORM).copy()
    s[3] *= 2
    record["smoothing"]["scales"][NORM]["source_scales"] = base64.b64encode(s.astype("<f4").tobytes()).decode()
    (copy / "qconvert.json").write_text(json.dumps(record))
    code, report, _ = verify(copy, capsys)
    assert code == 1
    assert f"{NORM}.weight: 1 of 64 values are not the reference's with the smoothing scales qconvert.json " \
           "records folded in" in report["integrity"]["problems"]


def test_a_record_without_scales_asks_for_a_new_conversion_in_one_line(copy, capsys):
    record = json.loads((copy / "qconvert.json").read_text())
    del record["smoothing"]["scales"], record["smoothing"]["encoding"], record["format_version"]
    (copy / "qconvert.json").write_text(json.dumps(record))
    code, report, err = verify(copy, capsys)
    line = ("qconvert.json: records no smoothing scales (format 1, written by an older qconvert); "
            "convert the model again to verify it")
    assert code == 6 and report["error"] == line and not report["passed"]  # an invalid folder: exit 6
    assert err.strip().splitlines() == [f"qconvert: error: {line}"]
