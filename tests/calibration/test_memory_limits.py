"""The memory calibration may take is the least of the machine's, RLIMIT_AS's and the cgroup's: a run under a
limit is refused before any window is made (exit 2, one line naming the limit), not ended by the allocator."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree
from qconvert.calibration import memory_limits
from qconvert.calibration.memory_limits import available, cgroup_left

GiB, MiB = 2**30, 2**20
QCONVERT = str(Path(sys.executable).parent / "qconvert")


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_cgroup_v2_the_tightest_level_from_the_group_up(tmp_path):
    root = tmp_path / "sys-fs-cgroup"
    _write(root, {"cgroup.controllers": "memory\n"})  # the root group has no memory.max
    _write(root / "pod", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{512 * MiB}\n",
                          "memory.stat": f"anon {256 * MiB}\ninactive_file {128 * MiB}\nactive_file 1\n"})
    _write(root / "pod" / "ctr", {"memory.max": "max\n", "memory.current": f"{300 * MiB}\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/ctr\n")
    headroom = cgroup_left(proc, root)
    assert headroom.bytes == 2 * GiB - 512 * MiB + 128 * MiB
    assert str(root / "pod" / "memory.max") in headroom.source and "2.0 GiB" in headroom.source
    _write(root / "pod" / "ctr", {"memory.max": f"{GiB}\n"})  # a tighter limit below
    assert cgroup_left(proc, root).bytes == GiB - 300 * MiB
    proc.write_text("0::/\n")  # a cgroup namespace: the group is the mount itself, here unlimited
    assert cgroup_left(proc, root) is None


def test_cgroup_v1_memory_limit_in_bytes_and_its_no_limit(tmp_path):
    root = tmp_path / "sys-fs-cgroup"
    unlimited = "9223372036854771712\n"  # what v1 writes for no limit
    _write(root / "memory", {"memory.limit_in_bytes": unlimited})
    _write(root / "memory" / "job", {"memory.limit_in_bytes": f"{3 * GiB}\n", "memory.usage_in_bytes": f"{GiB}\n",
                                     "memory.stat": f"cache 5\ntotal_inactive_file {64 * MiB}\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/job\n4:cpu,memory:/job\n0::/job\n")
    assert cgroup_left(proc, root).bytes == 2 * GiB + 64 * MiB
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(unlimited)
    assert cgroup_left(proc, root) is None
    assert cgroup_left(tmp_path / "absent", root) is None


def test_the_least_of_the_machine_and_the_cgroup_is_taken(tmp_path, monkeypatch):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(root / "tight", {"memory.max": f"{64 * MiB}\n", "memory.current": "0\n"})
    proc.write_text("0::/tight\n")
    assert available(proc, root).bytes == 64 * MiB
    monkeypatch.setattr(memory_limits, "machine_available", lambda: memory_limits.Headroom(MiB, "the machine"))
    assert available(proc, root) == memory_limits.Headroom(MiB, "the machine")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("limits") / "src", hidden=64, layers=1)


# 20,000 windows of 256 tokens (the model's longest) of a hidden size of 64: about 4.4 GiB in all.
HUGE = ["--scheme", "w8a8", "--calib", "random", "--calib-samples", "20000", "--calib-seqlen", "256", "--json"]


def test_a_cgroup_memory_max_refuses_before_the_work(llama, tmp_path, capsys, monkeypatch):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(root / "ci", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n"})
    proc.write_text("0::/ci\n")
    monkeypatch.setattr(memory_limits, "PROC_CGROUP", proc)
    monkeypatch.setattr(memory_limits, "CGROUP_ROOT", root)
    work = tmp_path / "work"
    work.mkdir()
    before = tree(work)
    code, stdout, stderr = run(["quantize", str(llama), "-o", str(work / "out"), *HUGE], capsys)
    assert code == 2
    (line,) = stderr.splitlines()
    assert line.startswith("qconvert: error: calibrating on 20,000 x 256 tokens needs about ")
    assert (f"and 1.0 GiB is there under this process's cgroup memory limit ({root / 'ci' / 'memory.max'}, "
            "2.0 GiB); fewer --calib-samples") in line
    document = json.loads(stdout)
    assert document["exit_code"] == 2 and document["error"] == line.removeprefix("qconvert: error: ")
    assert tree(work) == before


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child only sets its limit before exec
def test_rlimit_as_refuses_before_the_allocator_aborts(llama, tmp_path):
    limit = 4 * GiB  # room for JAX to start (about 1.5 GiB of address space), not for 4.4 GiB more

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    work = tmp_path / "work"
    work.mkdir()
    before = tree(work)
    done = subprocess.run([QCONVERT, "quantize", str(llama), "-o", str(work / "out"), *HUGE], preexec_fn=limited,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert "GiB is there under this process's address space limit (RLIMIT_AS, 4.0 GiB); fewer --calib-samples" \
        in line, line
    assert json.loads(done.stdout)["exit_code"] == 2
    assert tree(work) == before
