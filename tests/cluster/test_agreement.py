"""The processes of a run agree on one run before any work: every setting of the command and of the options
object (derived from them, not listed by hand), refused at the join by every process, exit 2 naming the first
that differs; and what the join reads from outside (launchers' variables, QCONVERT_JOIN_TIMEOUT)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cluster_helpers import finish, free_port, launch, the_document, the_error


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("source") / "llama"
    make_llama_checkpoint(folder, dtype="bfloat16", shards=2)
    return folder


@pytest.mark.parametrize("flags, shown", [
    (["--dry-run"], "--dry-run True, process 0 with False"),
    (["--max-shard-size", "1MB"], "--max-shard-size 1000000, process 0 with 5368709120"),
    (["--overwrite"], "--overwrite True, process 0 with False"),
    (["--upload-repo", "a/b"], "--upload-repo 'a/b', process 0 with None"),
])
def test_processes_given_other_settings_are_refused_before_any_work(flags, shown, llama, tmp_path):
    """One process with the flag, the other without: both refuse at the join (before a dry run returns early,
    before OUT is looked at), each with its own --json document."""
    port = free_port()
    args = ["quantize", str(llama), "-o", str(tmp_path / "out"), "--scheme", "int8", "--json"]
    results = finish([launch([*args, *(flags if i else [])], port, 2, i) for i in (0, 1)], timeout=60)
    line = f"process 1 was started with {shown}; start every process with the same flags"
    for code, out, err in results:
        assert code == 2
        assert the_error(err) == line
        the_document(out, 2, line)
    assert list(tmp_path.iterdir()) == []


def test_out_and_json_are_agreed_too(llama, tmp_path):
    port = free_port()
    results = finish([launch(["quantize", str(llama), "-o", str(tmp_path / f"out{i}"), *(["--json"] if i else [])],
                             port, 2, i) for i in (0, 1)], timeout=60)
    line = (f"process 1 was started with --out {str(tmp_path / 'out1')!r}, process 0 with "
            f"{str(tmp_path / 'out0')!r}; start every process with the same flags")
    assert [code for code, _, _ in results] == [2, 2]
    assert the_error(results[0][2]) == line and results[0][1] == ""  # process 0 was not given --json
    the_document(results[1][1], 2, the_error(results[1][2]))
    assert list(tmp_path.iterdir()) == []


def test_every_field_of_the_options_object_is_agreed():
    """A field added to ConvertOptions or CalibrationOptions is compared without anyone listing it."""
    from qconvert.cluster.settings import options_settings
    from qconvert.options import CalibrationOptions, ConvertOptions

    options = ConvertOptions(scheme="int4", calibration=CalibrationOptions(calib_samples=9))
    settings = options_settings(options, Path("o"), {"card_repo": "upload_repo"})
    names = {f.name for f in dataclasses.fields(ConvertOptions) if f.name != "calibration"}
    names |= {f.name for f in dataclasses.fields(CalibrationOptions)}
    expected = {"--" + {"card_repo": "upload_repo"}.get(n, n).replace("_", "-") for n in names} | {"--out"}
    assert set(settings) == expected
    assert settings["--calib-samples"] == 9 and settings["--scheme"] == "int4" and settings["--out"] == "o"


def test_every_option_of_each_command_is_agreed():
    """Every click option of quantize, calibrate and verify is compared but those that place a process in the
    run or only change what it prints."""
    import click

    from qconvert.cli.main import cli
    from qconvert.cluster.settings import PER_PROCESS, command_settings

    for name in ("quantize", "calibrate", "verify"):
        command = cli.commands[name]
        with click.Context(command) as ctx:
            ctx.params = {p.name: p.get_default(ctx) for p in command.params}
            settings = command_settings()
        options = [p for p in command.params if isinstance(p, click.Option)]
        assert set(settings) == {"the command", "qconvert version"} | {
            max(p.opts, key=len) for p in options if p.name not in PER_PROCESS}, name
        assert {"--json", "--coordinator"} & set(settings) == {"--json"}


def test_the_first_difference_is_named_in_process_0s_order():
    from qconvert.cluster.settings import first_difference

    assert first_difference({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None
    assert first_difference({"a": 1, "b": 2}, {"b": 3, "a": 0}) == ("a", 0, 1)
    assert first_difference({"a": 1}, {"a": 1, "z": 5}) == ("z", 5, None)
    assert first_difference({"a": 1, "b": 2}, {"a": 1}) == ("b", None, 2)


@pytest.mark.parametrize("value, seconds", [("", 120.0), ("5", 5.0), (" 2.5 ", 2.5)])
def test_the_join_timeout_is_read_in_one_place(value, seconds):
    from qconvert.cluster.joining import join_timeout

    assert join_timeout({"QCONVERT_JOIN_TIMEOUT": value}) == seconds


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "1e9", "\u0665", "five"])
def test_a_join_timeout_that_is_no_number_of_seconds_is_refused(value):
    from qconvert.cluster.joining import join_timeout
    from qconvert.formats.errors import UsageError

    with pytest.raises(UsageError, match=r"^QCONVERT_JOIN_TIMEOUT=.* is not a number of seconds in 1\.\.86400$"):
        join_timeout({"QCONVERT_JOIN_TIMEOUT": value})


def test_launchers_are_read_as_each_means_them():
    from qconvert.cluster.launchers import place_from_environment

    task = {"SLURM_JOB_ID": "4097", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "node[003-004],gpu7"}
    place = place_from_environment(task)
    # The step's count, not the allocation's; the step's first host; the port JAX derives (4097 % 4096 + 61440).
    assert (place.launcher, place.coordinator, place.count, place.index) == ("SLURM", "node003:61441", 2, 1)
    assert place_from_environment({**task, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "node003:1234"
    mpi = place_from_environment({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                                  "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"})
    # JAX's port: the job id (1531576320 / 4096 = 373920) modulo 4096, from 61440.
    assert (mpi.coordinator, mpi.count, mpi.index) == ("10.96.0.1:62624", 4, 3)


def test_a_launcher_that_says_too_little_is_refused_naming_what_it_read():
    from qconvert.cluster.launchers import place_from_environment
    from qconvert.formats.errors import ClusterError

    with pytest.raises(ClusterError) as refused:
        place_from_environment({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert str(refused.value) == (
        "cannot join the run's processes: the environment (Open MPI: OMPI_COMM_WORLD_SIZE='2', "
        "OMPI_COMM_WORLD_RANK='1') does not say where process 0 is, how many processes there are and which this "
        "is; give --coordinator, --num-processes and --process-id")
    with pytest.raises(ClusterError, match=r"\(JAX_COORDINATOR_ADDRESS: JAX_COORDINATOR_ADDRESS='h:1'\)"):
        place_from_environment({"JAX_COORDINATOR_ADDRESS": "h:1"})
    task = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}
    for address in ("::", "h:port", "h:99999", "h:\u0661"):  # not HOST:PORT: refused, never a crash
        with pytest.raises(ClusterError, match=r"^cannot join the run's processes: the environment \(SLURM: "):
            place_from_environment({**task, "JAX_COORDINATOR_ADDRESS": address})
