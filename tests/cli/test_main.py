"""`qconvert quantize` and `qconvert inspect` from the command line: outputs, and one line plus a distinct exit code for each bad input."""

import errno
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cli_helpers import run
from checkpoints import make_llama_checkpoint
import qconvert.write.output as output_module
import qconvert.write.tensors as tensors_module


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("cli") / "src", shards=2)


def fresh_copy(source, tmp_path):
    import shutil

    return shutil.copytree(source, tmp_path / "src")


def _missing_folder(src, tmp):
    return str(tmp / "does-not-exist")


def _uncached_hub_id(src, tmp):
    return "some-org/not-in-any-cache"


def _unsupported_architecture(src, tmp):
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (src / "config.json").write_text(json.dumps(config))
    return str(src)


def _config_missing(src, tmp):
    (src / "config.json").unlink()
    return str(src)


def _config_invalid(src, tmp):
    (src / "config.json").write_text("{\"architectures\": [")
    return str(src)


def _truncated_safetensors(src, tmp):
    path = src / "model-00002-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    return str(src)


def _corrupt_header(src, tmp):
    path = src / "model-00001-of-00002.safetensors"
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    return str(src)


def _index_names_missing_file(src, tmp):
    (src / "model-00002-of-00002.safetensors").unlink()
    return str(src)


def _index_path_outside_folder(src, tmp):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(src)


def _nan_weight(src, tmp):
    for path in src.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in tensors:
            if name.endswith("mlp.down_proj.weight"):
                tensors[name].reshape(-1)[0] = np.nan
        save_file(tensors, str(path), metadata={"format": "pt"})
    return str(src)


def _bad_shape(src, tmp):
    for path in src.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in list(tensors):
            if name == "model.layers.0.self_attn.o_proj.weight":
                tensors[name] = np.zeros((4, 4, 4), np.float32)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return str(src)


def _only_pickles(src, tmp):
    for path in list(src.glob("*.safetensors")):
        path.unlink()
    (src / "model.safetensors.index.json").unlink()
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    return str(src)


BAD_INPUTS = [
    (_missing_folder, 3, "no such folder"),
    (_uncached_hub_id, 4, "not in the cache"),
    (_unsupported_architecture, 5, "GPT2LMHeadModel"),
    (_only_pickles, 5, "pickled weights"),
    (_config_missing, 6, "config.json"),
    (_config_invalid, 6, "config.json"),
    (_truncated_safetensors, 6, "truncated"),
    (_corrupt_header, 6, "corrupt"),
    (_index_names_missing_file, 6, "missing"),
    (_index_path_outside_folder, 6, "outside"),
    (_nan_weight, 7, "NaN"),
    (_bad_shape, 7, "o_proj"),
]


@pytest.mark.parametrize("make_bad,code,words", BAD_INPUTS, ids=[b[0].__name__.strip("_") for b in BAD_INPUTS])
def test_bad_input_gives_one_line_a_distinct_code_and_no_output(source, tmp_path, capsys, monkeypatch,
                                                                 make_bad, code, words):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    model = make_bad(fresh_copy(source, tmp_path), tmp_path)
    out = tmp_path / "out"
    exit_code, stdout, stderr = run(["quantize", model, "-o", str(out), "--scheme", "int8"], capsys)
    assert exit_code == code
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconvert: error: ") and words in lines[0]
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_unsupported_architecture_names_the_supported_list(source, tmp_path, capsys):
    model = _unsupported_architecture(fresh_copy(source, tmp_path), tmp_path)
    _, _, stderr = run(["quantize", model, "-o", str(tmp_path / "out")], capsys)
    assert "LlamaForCausalLM" in stderr and "BertModel" in stderr


def test_existing_output_is_refused_and_left_alone(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(out)], capsys)
    assert exit_code == 8 and "--overwrite" in stderr and len(stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces only a folder qconvert wrote (or an empty one): this one stays as it is.
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(out), "--overwrite", "--quiet"], capsys)
    assert exit_code == 8 and "not a folder qconvert wrote" in stderr and len(stderr.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    exit_code, _, _ = run(["quantize", str(source), "-o", str(out), "--overwrite", "--quiet"], capsys)
    assert exit_code == 0 and (out / "qconvert.json").exists()
    exit_code, _, _ = run(["quantize", str(source), "-o", str(out), "--overwrite", "--quiet", "--scheme", "nf4"],
                          capsys)
    assert exit_code == 0 and json.loads((out / "qconvert.json").read_text())["scheme"] == "nf4"


def test_full_disk_exits_9_and_leaves_nothing(source, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_module, "write_shards", full)
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 9 and "No space left on device" in stderr and len(stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ctrl_c_exits_130_and_leaves_nothing(source, tmp_path, capsys, monkeypatch):
    real = tensors_module.quantized_tensors
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tensors_module, "quantized_tensors", interrupted)
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 130 and stderr.strip() == "qconvert: error: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,words", [
    (["--max-shard-size", "lots"], "is not a size"),
    (["--scheme", "int8", "--double-quant"], "--double-quant"),
    (["--scheme", "fp6"], "fp6"),
    (["--revision", "main"], "--revision"),
])
def test_usage_errors_exit_2(source, tmp_path, capsys, argv, words):
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), *argv], capsys)
    assert exit_code == 2 and words in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_json_summary_and_inspect_json(source, tmp_path, capsys):
    out = tmp_path / "out"
    exit_code, stdout, stderr = run(["quantize", str(source), "-o", str(out), "--scheme", "nf4",
                                     "--double-quant", "--max-shard-size", "50KB", "--json"], capsys)
    assert exit_code == 0 and stderr == ""
    summary = json.loads(stdout)
    assert summary["scheme"] == "nf4" and summary["quantized_modules"] == 14
    assert summary["compression_ratio"] == pytest.approx(summary["input_bytes"] / summary["output_bytes"], rel=1e-3)
    manifest = json.loads((out / "qconvert.json").read_text())
    assert summary["files"] == manifest["files"] and manifest["flags"]["max_shard_size"] == 50_000
    exit_code, stdout, _ = run(["inspect", str(out), "--json"], capsys)
    report = json.loads(stdout)
    assert exit_code == 0 and report["scheme"] == "nf4" and report["hashes_ok"] is True
    assert report["quantized_modules"] == 14 and report["output_bytes"] == summary["output_bytes"]
    assert report["unchanged_tensors"] == summary["unchanged_tensors"] == len(report["tensors"]) - 14


def test_inspect_exits_1_when_a_file_changed(source, tmp_path, capsys):
    out = tmp_path / "out"
    run(["quantize", str(source), "-o", str(out), "--quiet"], capsys)
    (out / "config.json").write_text((out / "config.json").read_text() + " ")
    exit_code, stdout, _ = run(["inspect", str(out)], capsys)
    assert exit_code == 1 and "config.json" in stdout and "differs" in stdout and "unchanged" in stdout


def test_inspect_missing_folder_exits_3(tmp_path, capsys):
    exit_code, _, stderr = run(["inspect", str(tmp_path / "nothing")], capsys)
    assert exit_code == 3 and len(stderr.strip().splitlines()) == 1


def test_dry_run_lists_modules_and_writes_nothing(source, tmp_path, capsys):
    exit_code, stdout, _ = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--dry-run",
                                "--exclude", "*.down_proj"], capsys)
    assert exit_code == 0 and not (tmp_path / "out").exists()
    assert "model.layers.0.mlp.up_proj" in stdout and "would write 12 int8 linears" in stdout


def test_console_script_is_quiet_off_a_terminal(source, tmp_path):
    done = subprocess.run([sys.executable, "-c", "from qconvert.cli.main import main; main()", "quantize",
                           str(source), "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""  # no progress bar when stderr is not a TTY
    assert done.stdout.startswith("wrote ") and (tmp_path / "out" / "qconvert.json").exists()
    assert "vLLM TPU" not in done.stdout  # the TPU note is noise for everyone else: --verbose shows it
    shown = subprocess.run([sys.executable, "-c", "from qconvert.cli.main import main; main()", "quantize",
                            str(source), "-o", str(tmp_path / "out2"), "--verbose"], capture_output=True, text=True)
    # The servers table records vLLM TPU refusing weight-only int8 for Llama: said after the summary.
    assert shown.stdout.splitlines()[-1] == ("note: vLLM TPU 0.32 does not load --scheme int8 for llama; it loads "
                                             "fp8 (MODEL_IMPL_TYPE=vllm), w8a8 (MODEL_IMPL_TYPE=vllm), "
                                             "w4a8-fp8 (MODEL_IMPL_TYPE=vllm)")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["quantize", "x", "-o", "y", "--scheme", "int9"],
                                  ["verify", "x", "--samples", "0"], ["verify", "--help"], ["calibrate", "--help"],
                                  ["inspect", "--help"], ["verify", "no-such-folder"],
                                  ["inspect", "no-such-folder", "--json"], ["quantize", "./no-such-folder", "-o", "o"],
                                  ["calibrate", "./no-such-folder", "-o", "s.safetensors", "--json"]])
def test_version_help_and_bad_input_start_no_jax(argv):
    """--version, --help and the refusal of a bad flag or a missing folder need no computation: they paid JAX's
    import (2-4 s loaded)."""
    code = ("import sys\nfrom qconvert.cli.main import main\nsys.argv = ['qconvert', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nprint('jax' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


def test_verify_backend_choices_are_the_kernels_deployment_backends():
    from qconvert.cli.common import VERIFY_BACKENDS
    from qconvert.kernels.backends import deployment_backends

    assert list(VERIFY_BACKENDS) == deployment_backends()
