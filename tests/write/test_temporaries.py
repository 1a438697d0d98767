"""Temporaries beside OUT: named within NAME_MAX whatever OUT's name, and removed only when their maker is proven
dead on this machine and in this PID namespace (a run in another container on a shared volume keeps its own)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree
from qconvert.write import temporaries
from qconvert.write.temporaries import TEMPORARY_MARKER, owner_record, stale_temporaries, temporary_stem


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("temporaries") / "model")


def _proc_stat_start(pid: int) -> int:
    # The 22nd field of /proc/PID/stat, read here by hand: the name in parentheses may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("name", ["o" * 250, "o" * 255, "é" * 127, "a" * 237])
def test_any_out_name_the_file_system_takes_is_written_and_overwritten(model, tmp_path, capsys, name):
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / name
    code, stdout, stderr = run(["quantize", str(model), "-o", str(out), "--json"], capsys)
    assert (code, stderr) == (0, ""), stderr
    assert json.loads(stdout)["exit_code"] == 0 and json.loads(stdout)["out"] == str(out)
    first = tree(parent)
    assert {p.split("/")[0] for p in first} == {name}  # OUT alone: no temporary left beside it
    code, _, stderr = run(["quantize", str(model), "-o", str(out), "--scheme", "nf4", "--overwrite", "-q"], capsys)
    assert (code, stderr) == (0, "")
    assert {p.split("/")[0] for p in tree(parent)} == {name} and tree(parent) != first


def test_a_temporary_stem_fits_name_max_and_tells_long_names_apart():
    extra = len("..") + 8 + len(".scratch")
    assert temporary_stem("out") == "out"
    assert temporary_stem("o" * (255 - extra)) == "o" * (255 - extra)  # fits as it is: unchanged
    for name in ("o" * 250, "é" * 127, "日本" * 42, "o" * 236 + "é", os.fsdecode(b"\xff" * 250)):
        stem = temporary_stem(name)
        encoded = os.fsencode(stem)
        assert len(encoded) + extra <= 255
        prefix, digest = stem.rsplit("~", 1)
        assert name.startswith(prefix) and len(os.fsencode(prefix)) >= 255 - extra - 17 - 3
        assert digest == hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
        if not name.startswith("\udcff"):
            encoded.decode("utf-8")  # whole characters only
    a, b = "x" * 240 + "a", "x" * 240 + "b"
    assert temporary_stem(a) != temporary_stem(b) and temporary_stem(a) == temporary_stem(a)
    assert len(os.fsencode(temporary_stem("o" * 140, 143))) + extra <= 143  # eCryptfs' NAME_MAX


def test_the_marker_records_pid_start_time_namespace_boot_and_host(tmp_path):
    path = temporaries.make_temporary(tmp_path / "out", ".scratch")
    try:
        record = json.loads((path / TEMPORARY_MARKER).read_text())
        assert record == {"pid": os.getpid(), "start_time": _proc_stat_start(os.getpid()),
                          "pid_namespace": os.readlink("/proc/self/ns/pid"),
                          "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                          "host": os.uname().nodename}
        assert stale_temporaries(tmp_path / "out") == []
    finally:
        temporaries.discard(path)


def _here(pid: int) -> dict:
    return {**owner_record(), "pid": pid, "start_time": _proc_stat_start(pid) if Path(f"/proc/{pid}").exists()
            else 12345}


def test_only_temporaries_whose_maker_is_proven_dead_here_are_removed(model, tmp_path, capsys):
    parent = tmp_path / "parent"
    parent.mkdir()
    dead, live = _dead_pid(), os.getppid()
    stale = {".out.dead01.partial": _here(dead),                                    # died in this namespace
             ".out.reused.old": {**_here(live), "start_time": _here(live)["start_time"] + 1}}  # pid reused since
    kept = {".out.othern.partial": {**_here(dead), "pid_namespace": "pid:[1]"},    # another container's run
            ".out.otherb.scratch": {**_here(dead), "boot_id": "0" * 8},            # another machine's run
            ".out.otherh.partial": {**_here(dead), "host": "elsewhere"},           # another host
            ".out.live01.partial": _here(live),                                    # a process that still runs
            ".out.oldfmt.partial": f"{dead}\n",                                    # a record of a pid alone
            ".out.broken.partial": "{not json",                                    # a record half-written
            ".out.nopids.partial": {**_here(dead), "pid": "x"},
            ".other.dead02.partial": _here(dead)}                                  # another OUT's temporary
    for name, record in {**stale, **kept}.items():
        (parent / name).mkdir()
        (parent / name / "data.bin").write_bytes(b"x" * 10)
        text = record if isinstance(record, str) else json.dumps(record)
        (parent / name / TEMPORARY_MARKER).write_text(text)
    before = tree(parent)
    code, _, stderr = run(["quantize", str(model), "-o", str(parent / "out"), "-q"], capsys)
    assert (code, stderr) == (0, "")
    after = {k: v for k, v in tree(parent).items() if k.split("/")[0] != "out"}
    assert after == {k: v for k, v in before.items() if k.split("/")[0] not in stale}


def test_a_live_run_in_another_namespace_keeps_its_temporary_after_its_lock_is_gone(tmp_path):
    """On a volume where another container's lock is not seen (or after it ends), the record still says the
    folder is not this namespace's to judge: it is never removed from here."""
    out = tmp_path / "out"
    foreign = {**owner_record(), "pid": _dead_pid(), "pid_namespace": "pid:[4026531836]"
               if os.readlink("/proc/self/ns/pid") != "pid:[4026531836]" else "pid:[1]"}
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import json, sys; from pathlib import Path; from qconvert.write.temporaries import make_temporary, "
         "TEMPORARY_MARKER\n"
         f"path = make_temporary(Path({str(out)!r}), '.scratch')\n"
         f"(path / TEMPORARY_MARKER).write_text({json.dumps(foreign)!r})\n"
         "print(path, flush=True)\n"
         "sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = Path(child.stdout.readline().strip())
    try:
        assert path.is_dir() and stale_temporaries(out) == []  # locked
    finally:
        child.communicate("", timeout=60)
    assert stale_temporaries(out) == [] and path.is_dir()  # unlocked now, and still not proven dead here


def test_a_file_written_atomically_under_a_long_name_leaves_only_itself(tmp_path):
    """--json-file and calibrate's statistics file are staged the same way as OUT."""
    from qconvert.write.folder import write_file_atomically

    target = tmp_path / ("j" * 250 + ".json")  # 255 bytes
    write_file_atomically(target, lambda f: f.write(b"{}\n"), lambda: None)
    assert [p.name for p in tmp_path.iterdir()] == [target.name] and target.read_bytes() == b"{}\n"
