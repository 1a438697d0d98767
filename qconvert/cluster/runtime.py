"""Joining a run of several processes: from flags (--coordinator, --num-processes, --process-id) or from the
launcher's environment (srun, mpirun, JAX_COORDINATOR_ADDRESS), or as jax.distributed detects it (--cluster: TPU pod
slices, Kubernetes too).

After `start`, every device of every process is in `jax.devices()`; calibration's batches and GPTQ's solves
spread over them. Process 0 (the leader) writes every file; the others compute and write nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from qconvert.formats.errors import ClusterError, UsageError

# Seconds the processes wait for one another to join (jax.distributed's initialization_timeout).
JOIN_TIMEOUT_S = 120
# jax.distributed's own heartbeat timeout: on a miss it ends the process from C++ with no cleanup, so it is set
# well past the run's own watch (qconvert.cluster.watch.PEER_TIMEOUT_S), which acts first and cleans up.
HEARTBEAT_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process was asked to join: the flags given (None: not given)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    detect: bool = False  # --cluster: join as JAX's own detection finds the run (TPU pod, SLURM, MPI, Kubernetes)

    @property
    def flagged(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes, self.process_id))


class _State:
    def __init__(self) -> None:
        self.active = False
        self.index = 0
        self.count = 1
        self.watch = None


_state = _State()


def active() -> bool:
    """Whether this process is one of several in the run."""
    return _state.active


def process_index() -> int:
    return _state.index


def process_count() -> int:
    return _state.count


def is_leader() -> bool:
    """Whether this process writes (process 0, or the only one)."""
    return _state.index == 0


def watch():
    """The run's qconvert.cluster.watch.Watch (None for one process)."""
    return _state.watch


def launched_by_cluster(environ=os.environ) -> str | None:
    """The launcher whose environment says this is one of several processes, or None.

    Only launchers that start several processes count, seen from inside one of them: a SLURM task of an `srun`
    of several (not a shell of the allocation), a rank of an `mpirun` of several. A Cloud TPU VM's shell looks
    the same whether one process or every worker runs, so a pod slice asks for `--cluster`.
    """
    def count(name: str) -> int:
        try:
            return int(environ.get(name, "1") or 1)
        except ValueError:
            return 1

    if environ.get("JAX_COORDINATOR_ADDRESS", "").strip():
        return "JAX_COORDINATOR_ADDRESS"
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_PROCID") is not None and count("SLURM_NTASKS") > 1:
        return "SLURM"
    if count("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    return None


def check_launch(launch: Launch) -> None:
    """UsageError for flags that cannot describe a run (before anything starts)."""
    if not launch.flagged:
        return
    missing = [flag for flag, value in (("--coordinator", launch.coordinator),
                                        ("--num-processes", launch.num_processes),
                                        ("--process-id", launch.process_id)) if value is None]
    if missing and launch.num_processes != 1:
        raise UsageError(f"a run of several processes needs --coordinator, --num-processes and --process-id "
                         f"together; {', '.join(missing)} missing")
    if launch.coordinator is not None:
        host, _, port = launch.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--coordinator {launch.coordinator!r} is not HOST:PORT (process 0's host and a free "
                             "port, the same on every process)")
    if launch.num_processes is not None and launch.num_processes < 1:
        raise UsageError(f"--num-processes {launch.num_processes} is not a count of processes")
    if launch.process_id is not None and launch.num_processes is not None and not (
            0 <= launch.process_id < launch.num_processes):
        raise UsageError(f"--process-id {launch.process_id} is not in 0..{launch.num_processes - 1}")


def start(launch: Launch, before_joining=None) -> None:
    """Join the run's other processes (call before JAX starts a backend); one process: nothing happens.

    `before_joining()` runs first when there is a run to join (the CLI keeps native chatter off stdout)."""
    check_launch(launch)
    if launch.flagged:
        if launch.num_processes == 1:
            return
        where = launch.coordinator
    elif launch.detect:
        where = launched_by_cluster() or "the environment, as JAX detects it"
    else:
        where = launched_by_cluster()
        if where is None:
            return
    if before_joining is not None:
        before_joining()
    import jax

    from qconvert.cluster.watch import Watch

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes reduce over gloo
    try:
        jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                                   initialization_timeout=JOIN_TIMEOUT_S,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - jax raises RuntimeError, ValueError or its own XlaRuntimeError
        text = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ClusterError(f"cannot join the run's processes ({where}): {text}") from None
    _state.index, _state.count = jax.process_index(), jax.process_count()
    if _state.count == 1:
        return
    _state.active = True
    _state.watch = Watch.join(_state.index, _state.count, _coordinator_host(launch))


def _coordinator_host(launch: Launch) -> str:
    """The host the other processes reach process 0 at: the coordinator's."""
    from jax._src import distributed

    address = launch.coordinator or distributed.global_state.coordinator_address or "127.0.0.1:0"
    host = address.rpartition(":")[0].strip("[]")
    return host or "127.0.0.1"


# Seconds a failing process gives the watch to hear of another's failure first (a collective failed here
# because a peer died: the peer's failure is the one to report).
SETTLE_S = 3.0


def note_failure(line: str) -> None:
    """This process's error line (without `qconvert: error: `), said to the others when it leaves; from now on
    the watch leaves the reporting to this process's main thread."""
    _state.failure_line = line
    if _state.watch is not None:
        _state.watch.failing = True


def settle() -> None:
    """Before this process reports a failure: if another's failure decides the run, the watch ends this process
    (with that line and code) and this call does not return."""
    if _state.watch is not None and _state.watch.failed_elsewhere(SETTLE_S):
        import time

        time.sleep(PEER_GRACE_S)  # the watch's thread is ending the process


PEER_GRACE_S = 30.0


def leave(code: int) -> None:
    """End this process of the run with the run's exit code, agreed with the others (never returns)."""
    from qconvert import interrupts

    from qconvert.cluster.watch import failure_text

    decided = _state.watch.finish(code, getattr(_state, "failure_line", "") if code else "")
    final, process, _ = decided
    if final != 0 and process != _state.index and (code == 0 or code != final):
        sys.stderr.write(f"qconvert: error: {failure_text(decided)}\n")
    interrupts.flush_and_exit(final)
