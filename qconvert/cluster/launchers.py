"""Where this process stands in a run of several: read from the flags, or from the launcher's environment as
that launcher means it.

- `srun` (SLURM): a task of a step has SLURM_STEP_ID, SLURM_STEP_NUM_TASKS and SLURM_PROCID; the count is the
  step's (SLURM_STEP_NUM_TASKS), not the allocation's (SLURM_NTASKS). The shell of an allocation (an sbatch
  script, salloc) is one process, even where SLURM_PROCID=0 and SLURM_NTASKS say more.
- `mpirun` (Open MPI): OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK; process 0's host from OMPI_MCA_orte_hnp_uri
  (or PMIX_SERVER_URI), as JAX reads it.
- JAX_COORDINATOR_ADDRESS: the coordinator; the count and index from the launcher above.
- `--cluster` (a TPU pod slice, Kubernetes, or any launcher JAX knows): everything as JAX detects it.

A refusal names the variables it read and their values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from qconvert.formats.errors import ClusterError

# SLURM's step ids of the batch script, the extern step and an interactive step (not tasks of an srun step).
_SLURM_SPECIAL_STEPS = 0xFFFFFFF0


@dataclasses.dataclass(frozen=True)
class Place:
    """This process's place in the run: who said so, process 0's HOST:PORT, how many, which one."""

    launcher: str
    coordinator: str
    count: int
    index: int
    read: tuple[str, ...] = ()  # the environment variables read ("NAME=value")

    @property
    def said_by(self) -> str:
        return f"{self.launcher}: {', '.join(self.read)}" if self.read else self.launcher


def _read(environ: Mapping[str, str], *names: str) -> tuple[str, ...]:
    return tuple(f"{name}={environ[name]!r}" for name in names if name in environ)


def _count(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def slurm_task(environ: Mapping[str, str]) -> bool:
    """Whether this is a task of an srun step of several tasks (not the shell of an allocation)."""
    step = _count(environ, "SLURM_STEP_ID")
    tasks = _count(environ, "SLURM_STEP_NUM_TASKS")
    return (bool(environ.get("SLURM_JOB_ID")) and step is not None and step < _SLURM_SPECIAL_STEPS
            and tasks is not None and tasks > 1 and "SLURM_PROCID" in environ)


def open_mpi_rank(environ: Mapping[str, str]) -> bool:
    """Whether this is a rank of an mpirun of several (Open MPI)."""
    size = _count(environ, "OMPI_COMM_WORLD_SIZE")
    return size is not None and size > 1


def launched_by(environ: Mapping[str, str]) -> str | None:
    """The launcher whose environment says this is one of several processes, or None."""
    if environ.get("JAX_COORDINATOR_ADDRESS", "").strip():
        return "JAX_COORDINATOR_ADDRESS"
    if slurm_task(environ):
        return "SLURM"
    if open_mpi_rank(environ):
        return "Open MPI"
    return None


SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST",
                   "JAX_COORDINATOR_PORT")
OPEN_MPI_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI",
                      "JAX_COORDINATOR_PORT")


def place_from_environment(environ: Mapping[str, str] = os.environ) -> Place:
    """This process's place as its launcher's environment says (ClusterError naming the variables read when
    they do not describe a run)."""
    coordinator = environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None
    if slurm_task(environ):
        name, names = "SLURM", SLURM_VARIABLES
        count, index = _count(environ, "SLURM_STEP_NUM_TASKS"), _count(environ, "SLURM_PROCID")
        where = coordinator or _jax_address("slurm", environ)
    elif open_mpi_rank(environ):
        name, names = "Open MPI", OPEN_MPI_VARIABLES
        count, index = _count(environ, "OMPI_COMM_WORLD_SIZE"), _count(environ, "OMPI_COMM_WORLD_RANK")
        where = coordinator or _jax_address("ompi", environ)
    else:
        name, names = "JAX_COORDINATOR_ADDRESS", ("JAX_COORDINATOR_ADDRESS",)
        count = index = None
        where = coordinator
    read = _read(environ, *dict.fromkeys((*names, "JAX_COORDINATOR_ADDRESS") if coordinator else names))
    if not _address(where) or count is None or index is None or not 0 <= index < count:
        raise ClusterError(f"cannot join the run's processes: the environment ({name}: "
                           f"{', '.join(read) or 'none of ' + ', '.join(names)}) does not say where process 0 is, "
                           "how many processes there are and which this is; give --coordinator, --num-processes "
                           "and --process-id")
    return Place(name, where, count, index, read)


def _address(where: str | None) -> bool:
    """Whether `where` is HOST:PORT (a port in 1..65535)."""
    host, _, port = (where or "").rpartition(":")
    return bool(host.strip("[]")) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def _jax_address(method: str, environ: Mapping[str, str]) -> str | None:
    """Process 0's HOST:PORT as JAX's own detection reads the launcher's variables (None where they say none):
    SLURM's first host of the step, Open MPI's launcher host; the port JAX_COORDINATOR_PORT, else derived from
    the job's id in 61440..65535 as JAX derives it."""
    import re

    port = environ.get("JAX_COORDINATOR_PORT", "").strip()
    if method == "slurm":
        nodes, job = environ.get("SLURM_STEP_NODELIST", ""), _count(environ, "SLURM_JOB_ID")
        first = re.match(r"([^,\[]*)(?:\[([^,\]-]*))?", nodes)
        host = "".join(g or "" for g in first.groups()) if first else ""
        port = port or (str(job % 2**12 + 65535 - 2**12 + 1) if job is not None else "")
    else:
        uri = environ.get("OMPI_MCA_orte_hnp_uri") or environ.get("PMIX_SERVER_URI") or ""
        found = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        host = next((g for g in found.groups() if g), "") if found else ""
        job = uri.split(".", 1)[0]
        port = port or (str(int(job) // 2**12 % 2**12 + 65535 - 2**12 + 1) if job.isdigit() else "")
    return f"{host}:{port}" if host and port.isdigit() else None


def place_as_jax_detects(timeout_s: int) -> Place:
    """--cluster: this process's place as JAX's cluster detection finds it (a TPU pod slice, Kubernetes, SLURM,
    MPI); ClusterError where it finds none."""
    from jax._src import clusters

    try:
        coordinator, count, index, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, timeout_s)
    except Exception as err:  # noqa: BLE001 - a detector's own failure (a metadata server, a variable)
        text = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ClusterError(f"cannot join the run's processes (the environment, as JAX detects it): {text}") from None
    if not _address(coordinator) or count is None or index is None:
        raise ClusterError("cannot join the run's processes (the environment, as JAX detects it): no launcher "
                           "of several processes found (a TPU pod slice, SLURM, MPI, Kubernetes)")
    return Place("the environment, as JAX detects it", coordinator, int(count), int(index))
