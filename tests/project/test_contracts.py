"""The contracts of every command, held on generated hostile values (hypothesis): for every flag of every
command, the config fields and tensor names of a tiny checkpoint, the environment, and paths.

Whatever the value, a run ends with an exit code from the documented table (never 70, 134 or 139), at most one
stderr line with no control characters, exactly one JSON document on stdout under --json, nothing written
beside OUT, and the source unchanged. Examples are drawn deterministically (tests/conftest.py); CI draws a few
per test, QCONVERT_CONTRACT_EXAMPLES=N draws N.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint, make_tokenizer
from qconvert.cli.main import cli
from qconvert.formats.errors import EXIT_CODES

EXAMPLES = int(os.environ.get("QCONVERT_CONTRACT_EXAMPLES", "12"))
DOCUMENTED = {code for code, _ in EXIT_CODES} - {70}
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# The kinds of hostile value the contracts must survive.
UNICODE_DIGITS = st.sampled_from(["²", "١٢٨", "１２８", "߃", "Ⅻ", "٣.٥", "𝟙𝟚"])
CONTROL = st.lists(st.sampled_from(["\n", "\r", "\x1b[2J", "\x1b]0;t\x07", "\x00", "\x7f", "\u202e", "\u2028", "\t"]),
                   min_size=1, max_size=4).map(lambda parts: f"a{''.join(parts)}b")
NOT_UTF8 = st.binary(min_size=1, max_size=6).map(lambda b: os.fsdecode(b"x" + bytes(c | 0x80 for c in b)))
NUMBERS = st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "-0.0", "99999999999999999999999",
                           "1e-320", "0x10", "1_0", " 3 "])
PATHS = st.sampled_from(["/", "/etc/passwd", "../../../../etc", "./", "", " ", "~", "x/" * 300, "y" * 300,
                         "/dev/null", "/proc/self/mem", "-", "--", "hf://datasets/a/b//etc/passwd"])
STRINGS = st.one_of(st.just(""), st.text(max_size=40), st.just("z" * 100_000),
                    st.text(st.characters(categories=["Lo", "Nd", "No", "Nl"]), min_size=1, max_size=8))
HOSTILE = st.one_of(UNICODE_DIGITS, CONTROL, NOT_UTF8, NUMBERS, PATHS, STRINGS)


def _flags(command: str) -> list[str]:
    """Every flag of `command` that takes a value, from click's own tree (so a new flag is tried too)."""
    return sorted(param.opts[-1] for param in cli.commands[command].params
                  if isinstance(param, __import__("click").Option) and not param.is_flag)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("contracts") / "model")
    make_tokenizer(folder, vocab_size=256)
    return folder


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("contracts-out") / "int8"
    code, _, err = _in_process(["quantize", str(source), "-o", str(out), "-q"])
    assert code == 0, err
    return out


def _in_process(argv, cwd=None):
    """Run the CLI in this process (in folder `cwd`: a relative OUT lands there), capturing its streams;
    (code, stdout, stderr)."""
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
            contextlib.chdir(cwd or os.getcwd()):
        try:
            from qconvert.cli.main import main

            main(argv)
        except SystemExit as done:
            return done.code, stdout.getvalue(), stderr.getvalue()
    raise AssertionError("the CLI returned without an exit code")


def assert_contract(code, stdout, stderr, *, as_json: bool):
    """The invariants every run keeps, whatever it was given."""
    assert code in DOCUMENTED, (code, stderr)
    lines = stderr.splitlines()
    if code != 0:  # a failure's line; verify's failed check (1) says its verdict instead
        assert len(lines) == 1 and (code == 1 or lines[0].startswith("qconvert: ")), stderr
    assert all(line.isprintable() for line in lines), stderr
    if as_json:
        document = json.loads(stdout)  # exactly one document: json.loads refuses anything after it
        assert document["exit_code"] == code


def _beside_out(work, before, code, out: str) -> dict:
    """What the run left in `work` other than OUT (a relative or absolute path as given; only on success)."""
    after = tree(work)
    if code == 0:
        named = os.path.relpath(os.path.abspath(os.path.join(work, out)), work)
        # OUT, what it holds, and the folders on its way that the run made for it
        after = {k: v for k, v in after.items() if not (k == named or k.startswith(named + "/")
                                                        or named.startswith(k + "/"))}
    return {k: v for k, v in after.items() if before.get(k, "absent") != v}


def _workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("w")


@PROPERTY
@given(data=st.data())
def test_quantize_every_flag(source, tmp_path_factory, data):
    flag = data.draw(st.sampled_from(_flags("quantize")), label="flag")
    value = data.draw(HOSTILE, label="value")
    work = _workspace(tmp_path_factory)
    before, source_before = tree(work), tree(source)
    out = work / "out"
    argv = ["quantize", str(source), "-o", str(out), "--scheme", "w8a8", "--calib-samples", "2",
            "--calib-seqlen", "8", "--json", flag, value] if flag != "--out" else \
        ["quantize", str(source), "--json", "-o", value]
    code, stdout, stderr = _in_process(argv, cwd=work)
    assert_contract(code, stdout, stderr, as_json=True)
    assert tree(source) == source_before
    assert _beside_out(work, before, code, value if flag == "--out" else "out") == {}


@pytest.mark.parametrize("command", ["calibrate", "verify", "inspect"])
def test_other_commands_every_flag(command, source, converted, tmp_path_factory):
    @PROPERTY
    @given(data=st.data())
    def check(data):
        flags = _flags(command)
        flag = data.draw(st.sampled_from(flags), label="flag") if flags else None
        value = data.draw(HOSTILE, label="value")
        work = _workspace(tmp_path_factory)
        before, converted_before = tree(work), tree(converted)
        base = {"calibrate": ["calibrate", str(source), "-o", str(work / "stats.safetensors"),
                              "--calib-samples", "2", "--calib-seqlen", "8"],
                "verify": ["verify", str(converted), "--quick", "-q", "--json-file", str(work / "record.json")],
                "inspect": ["inspect", str(converted)]}[command]
        if flag in ("-o", "--out") and command != "inspect":
            base = [w for w in base if w not in ("-o", str(work / "stats.safetensors"))]
        argv = [*base, "--json", *((flag, value) if flag else (value,))]
        code, stdout, stderr = _in_process(argv, cwd=work)
        assert_contract(code, stdout, stderr, as_json=True)
        assert tree(converted) == converted_before
        named = value if flag in ("--out", "--json-file") else None
        # verify's record is written whatever the verdict; an OUT only on success
        written = 0 if flag == "--json-file" else code
        left = _beside_out(work, before, written, named) if named else _beside_out(work, before, 1, "")
        assert set(left) <= {"stats.safetensors", "record.json"}

    check()


CONFIG_VALUES = st.one_of(st.sampled_from([float("nan"), float("inf"), -1, 0, 10**30, -(10**30), 1e308, "",
                                           "nan", [], {}, None, True, "²", "٣"]), STRINGS, CONTROL)
CONFIG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                 "initializer_range", "torch_dtype", "architectures", "model_type", "tie_word_embeddings",
                 "head_dim", "rope_scaling", "hidden_act", "bos_token_id"]


@PROPERTY
@given(field=st.sampled_from(CONFIG_FIELDS), value=CONFIG_VALUES)
def test_hostile_config_values(source, tmp_path_factory, field, value):
    work = _workspace(tmp_path_factory)
    model = shutil.copytree(source, work / "model")
    config = json.loads((model / "config.json").read_text())
    config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    before = tree(work)
    code, stdout, stderr = _in_process(["quantize", str(model), "-o", str(work / "out"), "--json", "-q"], cwd=work)
    assert_contract(code, stdout, stderr, as_json=True)
    assert _beside_out(work, before, code, "out") == {}


NAMES = st.one_of(CONTROL, STRINGS, st.sampled_from(["model.layers.٣.mlp.down_proj.weight",
                                                     "model.layers.-1.self_attn.q_proj.weight",
                                                     "model.layers.99999999999999999999.mlp.up_proj.weight",
                                                     "model.layers.0.mlp.down_proj.weight/../../x", "__metadata__",
                                                     "model.embed_tokens.weight\udcff"]))


@PROPERTY
@given(name=NAMES)
def test_hostile_tensor_names(source, tmp_path_factory, name):
    work = _workspace(tmp_path_factory)
    model = shutil.copytree(source, work / "model")
    try:
        save_file({name: np.zeros((2, 2), np.float32)}, str(model / "extra.safetensors"))
    except Exception:  # noqa: BLE001 - a name safetensors itself cannot write cannot reach qconvert
        return
    before = tree(work)
    code, stdout, stderr = _in_process(["quantize", str(model), "-o", str(work / "out"), "--json", "-q"], cwd=work)
    assert_contract(code, stdout, stderr, as_json=True)
    assert _beside_out(work, before, code, "out") == {}


ENVIRONMENT = ["HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_HUB_ETAG_TIMEOUT",
               "HF_HUB_DOWNLOAD_TIMEOUT", "HF_TOKEN", "XLA_FLAGS", "JAX_PLATFORMS", "JAX_ENABLE_X64",
               "JAX_NUM_CPU_DEVICES", "JAX_DEFAULT_MATMUL_PRECISION", "SLURM_JOB_ID",
               "SLURM_PROCID", "SLURM_NTASKS", "FORCE_COLOR", "NO_COLOR", "QCONVERT_DEBUG"]
ENV_VALUES = st.one_of(UNICODE_DIGITS, NUMBERS, st.sampled_from(["", "maybe", "1", "2", "yes", "http://", "::",
                                                                 "localhost:0", "--xla_bogus=1", "tpu", "\u202e"]))


@settings(max_examples=max(3, EXAMPLES // 2), deadline=None)
@given(name=st.sampled_from(ENVIRONMENT), value=ENV_VALUES)
def test_hostile_environment(source, tmp_path_factory, name, value):
    """Each in its own process: JAX, XLA and huggingface_hub read their variables when they load."""
    work = _workspace(tmp_path_factory)
    before = tree(work)
    env = {**os.environ, name: value, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    if name == "HF_HUB_OFFLINE":
        env[name] = value
    done = subprocess.run([sys.executable, "-m", "qconvert.cli.main", "quantize", str(source), "-o",
                           str(work / "out"), "--json", "-q"], env=env, capture_output=True, text=True, timeout=300,
                          cwd=work)
    assert_contract(done.returncode, done.stdout, done.stderr, as_json=True)
    assert _beside_out(work, before, done.returncode, "out") == {}


@PROPERTY
@given(command=st.sampled_from(["quantize", "calibrate", "inspect", "verify"]), value=HOSTILE)
def test_hostile_positional_paths(tmp_path_factory, command, value):
    """MODEL of quantize and calibrate, OUT of inspect and verify: whatever path or text they are given."""
    work = _workspace(tmp_path_factory)
    before = tree(work)
    argv = [command, value, "--json"] + (["-o", "out"] if command in ("quantize", "calibrate") else [])
    code, stdout, stderr = _in_process(argv, cwd=work)
    assert_contract(code, stdout, stderr, as_json=True)
    assert code != 0 and _beside_out(work, before, code, "out") == {}
