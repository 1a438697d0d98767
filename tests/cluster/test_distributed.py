"""A run of several processes is one conversion (jax.distributed): the real runtime, 2 processes on 127.0.0.1 with
2 forced CPU devices each, against the same conversion in one process on one device (and on 4), byte for byte;
and what happens when one process dies, fails, or reads other files."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import tree
from cluster_helpers import command, env, finish, free_port
from hf_checkpoints import make_hf_checkpoint

# Enough windows that the batches fill whole groups of 4 devices (8 per batch) and leave some over.
CALIB = ["--calib", "random", "--calib-samples", "40", "--calib-seqlen", "32"]


def run_one(args: list[str], devices: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(command(args), env=env(devices), capture_output=True, text=True, timeout=300)


def start_run(args_of, processes: int = 2, devices: int = 2) -> list[subprocess.Popen]:
    """`args_of(i)`: process i's arguments; each process is given the run's flags."""
    port = free_port()
    return [subprocess.Popen(command([*args_of(i), "--coordinator", f"127.0.0.1:{port}", "--num-processes",
                                      str(processes), "--process-id", str(i)]),
                             env=env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(processes)]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("qconvert: error:")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    make_llama_checkpoint(root / "llama", dtype="bfloat16", outlier_channels=(3, 17), shards=2)
    make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe")
    return {"llama": root / "llama", "qwen3_moe": root / "qwen3_moe"}


CASES = {
    # AWQ's search, then GPTQ on the scaled weights: both spread over the devices
    "llama-int4-awq-gptq": ("llama", ["--scheme", "int4", "--awq"]),
    "llama-w8a8-alpha-search-gptq": ("llama", ["--scheme", "w8a8", "--gptq"]),
    "qwen3_moe-int4-gptq": ("qwen3_moe", ["--scheme", "int4"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_of_two_devices_write_the_bytes_of_one_device(case, sources, tmp_path):
    source, flags = CASES[case]
    args = ["quantize", str(sources[source]), *flags, *CALIB, "-q"]
    alone = run_one([*args, "-o", str(tmp_path / "one")])
    assert alone.returncode == 0, alone.stderr
    results = finish(start_run(lambda i: [*args, "-o", str(tmp_path / "two")]))
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert tree(tmp_path / "two") == tree(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # process 1 wrote nothing, no debris
    if case == "llama-w8a8-alpha-search-gptq":  # and four devices of one process, the same again
        four = run_one([*args, "-o", str(tmp_path / "four")], devices=4)
        assert four.returncode == 0, four.stderr
        assert tree(tmp_path / "four") == tree(tmp_path / "one")


def test_experts_split_over_two_processes_convert_within_rounding_of_one_device(sources, tmp_path):
    """--shard-experts always: Qwen3-MoE's 4 experts a layer, one on each device of 2 processes x 2. The folder
    verifies and holds one device's tensors; the tensors rounded before any expert's output enters (layer 0's
    attention, its experts' gate and up: the same Hessians, each expert's summed by its owner as one device sums
    it) are one device's bytes, and the rest differ in a few int4 codes at most (float32 rounding)."""
    import numpy as np
    from safetensors.numpy import load_file

    args = ["quantize", str(sources["qwen3_moe"]), "--scheme", "int4", "--no-awq", *CALIB, "-q"]
    alone = run_one([*args, "-o", str(tmp_path / "one")])
    assert alone.returncode == 0, alone.stderr
    results = finish(start_run(lambda i: [*args, "--shard-experts", "always", "-o", str(tmp_path / "two")]))
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    one, two = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert sorted(one) == sorted(two)
    records = [json.loads((tmp_path / name / "qconvert.json").read_text())["calibration"] for name in ("one", "two")]
    assert "experts_split_over" not in records[0] and records[1]["experts_split_over"] == 4
    first = [k for k in one if k.startswith("model.layers.0.") and not k.startswith("model.layers.0.mlp.experts.")
             or "layers.0.mlp.experts." in k and ("gate_proj" in k or "up_proj" in k)]
    assert first and all(np.array_equal(one[k], two[k]) for k in first)
    codes = [k for k in one if k.endswith(".weight_packed")]
    nibbles = sum(one[k].size * 8 for k in codes)
    changed = sum(int(np.sum((one[k][..., None] >> np.arange(0, 32, 4)) & 15 != (two[k][..., None] >>
                                                                                np.arange(0, 32, 4)) & 15))
                  for k in codes)
    assert changed <= nibbles // 100, (changed, nibbles)
    verified = subprocess.run(command(["verify", str(tmp_path / "two"), "--json"]), env=env(1),
                              capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]


def test_calibrate_and_verify_run_as_several_processes(sources, tmp_path):
    stats_args = ["calibrate", str(sources["llama"]), *CALIB, "-q"]
    alone = run_one([*stats_args, "-o", str(tmp_path / "one.safetensors")])
    assert alone.returncode == 0, alone.stderr
    results = finish(start_run(lambda i: [*stats_args, "-o", str(tmp_path / "two.safetensors")]))
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert (tmp_path / "two.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()

    folder = tmp_path / "int8"
    assert run_one(["quantize", str(sources["llama"]), "-o", str(folder), "-q"]).returncode == 0
    verify = ["verify", str(folder), "--quick", "--backend", "xla", "--json"]
    results = finish(start_run(lambda i: verify))
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    spread = json.loads(results[0][1])  # stdout holds the JSON alone (no native chatter)
    assert spread["passed"] is True
    assert results[1][1] == ""  # process 0 speaks for the run
    # The linears were compared where they landed, over both processes' devices: the report is one process's,
    # but for its time and the devices it names.
    one = run_one(verify)
    assert one.returncode == 0, one.stderr
    assert len(spread["devices"]) == 4
    assert {**json.loads(one.stdout), "seconds": 0, "devices": 0} == {**spread, "seconds": 0, "devices": 0}


def test_a_killed_process_ends_the_run_within_the_bound(sources, tmp_path):
    source = tmp_path / "llama"
    shutil.copytree(sources["llama"], source)
    before = tree(tmp_path)
    args = ["quantize", str(source), "--scheme", "int4", "--calib", "random", "--calib-samples", "4000",
            "--calib-seqlen", "32", "-o", str(tmp_path / "out")]
    procs = start_run(lambda i: args)
    # Kill process 1 once calibration has begun (process 0's line says so; its scratch folder exists).
    line, started = "", time.monotonic()
    while "calibrating on" not in line and time.monotonic() - started < 120:
        line = procs[0].stderr.readline()
        assert line or procs[0].poll() is None, "process 0 ended before calibrating"
    time.sleep(2)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = procs[0].communicate(timeout=90)
    waited = time.monotonic() - killed
    procs[1].communicate()
    assert waited < 60
    assert procs[0].returncode == 10
    assert errors(err) == ["qconvert: error: process 1 of 2 stopped without a word (killed, out of memory, or its "
                           "host gone)"]
    assert tree(tmp_path) == before  # no OUT, no staging or scratch folder, the source untouched


def test_copies_that_differ_are_refused_by_every_process(sources, tmp_path):
    copies = [tmp_path / "a", tmp_path / "b"]
    for copy in copies:
        shutil.copytree(sources["llama"], copy)
    config = copies[1] / "generation_config.json"
    config.write_text(config.read_text().replace("}", ', "note": 1}', 1))
    results = finish(start_run(lambda i: ["quantize", str(copies[i]), "--scheme", "int4", *CALIB,
                                          "-o", str(tmp_path / "out")]))
    assert [code for code, _, _ in results] == [6, 6]
    for _, _, err in results:
        (line,) = errors(err)
        assert "process 1's copy of the model differs from process 0's at generation_config.json" in line
    assert not (tmp_path / "out").exists()


def test_processes_started_with_other_flags_are_refused_by_every_process(sources, tmp_path):
    results = finish(start_run(lambda i: ["quantize", str(sources["llama"]), "--scheme", "int4", *CALIB,
                                          *(["--gptq-damp", "0.05"] if i else []), "-o", str(tmp_path / "out")]))
    assert [code for code, _, _ in results] == [2, 2]
    for _, _, err in results:
        (line,) = errors(err)
        # Its own line, or (when the watch ends it first) the same line as process 0's failure.
        assert line.endswith("process 1 was started with --gptq-damp 0.05, process 0 with None; start every "
                             "process with the same flags")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,shown", [(["--kv-cache", "fp8"], "--kv-cache 'fp8'"), (["--dry-run"], "--dry-run True")])
def test_a_flag_that_decides_whether_a_process_calibrates_is_agreed_before_it_does(flag, shown, sources, tmp_path):
    """int8 calibrates only with --kv-cache, and a dry run not at all: one process alone with the flag would
    wait for the other in calibration's collectives; both are refused instead."""
    results = finish(start_run(lambda i: ["quantize", str(sources["llama"]), "--scheme", "int8",
                                          *(flag if i else []), "-o", str(tmp_path / "out")]))
    assert [code for code, _, _ in results] == [2, 2]
    for _, _, err in results:
        (line,) = errors(err)
        assert f"process 1 was started with {shown}, process 0 with" in line
    assert not (tmp_path / "out").exists()


def test_a_refusal_of_process_0_ends_every_process_with_its_code(sources, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("not qconvert's")
    results = finish(start_run(lambda i: ["quantize", str(sources["llama"]), "--scheme", "int4", *CALIB,
                                          "-o", str(tmp_path / "out")]))
    assert [code for code, _, _ in results] == [8, 8]
    (line,) = errors(results[1][2])
    assert line.startswith("qconvert: error: process 0 failed: ") and "already exists" in line
    assert (tmp_path / "out" / "mine.txt").read_text() == "not qconvert's"


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0"], "--coordinator missing"),
    (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"], "is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"], "is not in 0..1"),
])
def test_launch_flags_that_cannot_describe_a_run_are_one_line(flags, message, sources, tmp_path):
    result = run_one(["quantize", str(sources["llama"]), "-o", str(tmp_path / "out"), *flags])
    assert result.returncode == 2
    (line,) = errors(result.stderr)
    assert message in line
    assert not (tmp_path / "out").exists()


def test_cluster_where_no_launcher_started_several_processes_is_one_line(sources, tmp_path):
    result = run_one(["quantize", str(sources["llama"]), "-o", str(tmp_path / "out"), "--cluster"])
    assert result.returncode == 10
    (line,) = errors(result.stderr)
    assert line.startswith("qconvert: error: cannot join the run's processes (the environment, as JAX detects it)")
    assert not (tmp_path / "out").exists()


def test_the_launchers_that_start_several_processes_are_recognized():
    from qconvert.cluster.runtime import launched_by_cluster

    task = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_PROCID": "2"}
    assert launched_by_cluster({}) is None
    assert launched_by_cluster(task) == "SLURM"  # a task of an srun step of 4
    assert launched_by_cluster({**task, "SLURM_STEP_NUM_TASKS": "1"}) is None  # an srun of one task
    # The shell of an allocation (an sbatch script: SLURM_PROCID=0, the allocation's SLURM_NTASKS) is one process.
    assert launched_by_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) is None
    assert launched_by_cluster({**task, "SLURM_STEP_ID": str(0xFFFFFFFE)}) is None  # the batch step
    assert launched_by_cluster({"OMPI_COMM_WORLD_SIZE": "2"}) == "Open MPI"
    assert launched_by_cluster({"OMPI_COMM_WORLD_SIZE": "x"}) is None
    assert launched_by_cluster({"OMPI_COMM_WORLD_SIZE": "\u0662"}) is None  # a Unicode digit is no count
    assert launched_by_cluster({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}) is None  # a pod slice says --cluster
    assert launched_by_cluster({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) == "JAX_COORDINATOR_ADDRESS"


def test_owners_spread_the_largest_first_and_agree_everywhere():
    from qconvert.cluster.share import owners

    # By hand: 9 -> d0 (a tie goes low); 4 -> d1; 4 -> d1 (4 < 9); 2 -> d1 (8 < 9); 1 -> d0 (9 < 10).
    assert owners([1.0, 9.0, 4.0, 4.0, 2.0], 2) == [0, 0, 1, 1, 1]
    assert owners([5.0], 4) == [0]
    assert owners([], 3) == []


def test_packed_arrays_come_back_as_they_were():
    import numpy as np
    import jax.numpy as jnp

    from qconvert.cluster.share import pack, unpack

    arrays = {"a:qvalue": np.arange(12, dtype=np.int8).reshape(3, 4),
              "a:scale": np.asarray([0.5, -0.0, 3e-8], dtype=jnp.bfloat16),
              "b": np.zeros((0, 2), np.float32)}
    back, meta = unpack(pack(arrays, {"x": [1, "y"]}))
    assert meta == {"x": [1, "y"]}
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert back[name].tobytes() == array.tobytes()
