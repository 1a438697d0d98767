"""A run of several processes: how a process was asked to join it, its place and state, and how it leaves.
Joining it: from flags (--coordinator, --num-processes, --process-id) or from the
launcher's environment (srun, mpirun, JAX_COORDINATOR_ADDRESS), or as jax.distributed detects it (--cluster: TPU pod
slices, Kubernetes too).

After `start`, every device of every process is in `jax.devices()`; calibration's batches and GPTQ's solves
spread over them. Process 0 (the leader) writes every file; the others compute and write nothing.
"""

from __future__ import annotations

import dataclasses
import os

from qconvert.formats.errors import UsageError


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
        self.held = None  # process 0: the coordinator's port, held for the run
        self.failure_line = ""


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
    """The launcher whose environment says this is one of several processes, or None (qconvert.cluster.launchers:
    a task of an srun step, not the shell of an allocation; a rank of an mpirun of several; a TPU pod slice
    asks for --cluster)."""
    from qconvert.cluster.launchers import launched_by

    return launched_by(environ)


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


def leave(code: int, end) -> None:
    """End this process of the run with the run's exit code, agreed with the others (never returns).

    `end(final, line)` prints what the run's end says before the process exits: `line` is the failure to say
    (another process's that decided the run, or a signal's while waiting), or None when the run ended as this
    process said (its own document and line were its own to print)."""
    from qconvert import interrupts

    from qconvert.cluster.watch import failure_text

    try:
        decided = _state.watch.finish(code, _state.failure_line if code else "")
    except (KeyboardInterrupt, interrupts.Interrupted) as err:
        # A signal while waiting for the others: the others hear of it, and this process leaves with its
        # code, its one line and (where none was said yet) its document.
        signal_code, line = interrupts.exit_code_for(err), interrupts.message_for(err)
        _state.watch.tell(line, signal_code)
        if interrupts.claim_exit():
            end(signal_code, line)
        interrupts.flush_and_exit(signal_code)
    final, process, _ = decided
    elsewhere = final != 0 and process != _state.index and (code == 0 or code != final)
    end(final, failure_text(decided) if elsewhere else None)
    interrupts.flush_and_exit(final)
