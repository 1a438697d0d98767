"""Joining a run of several processes, so that native code never decides how it ends.

qconvert's own join comes first (qconvert.cluster.rendezvous: plain sockets, a deadline, the coordinator's port
held by process 0, duplicate ids refused, the run's settings compared), under one deadline read from
QCONVERT_JOIN_TIMEOUT. Only then does jax.distributed start, on a port process 0 chose, with JAX's own deadline
later than qconvert's (a stall ends the run with exit 10 and one line, never JAX's abort), without JAX's
preemption notifier (it would take SIGTERM from qconvert), and qconvert's signal handlers are put back after
it. gRPC's, absl's and XLA's log levels are set before JAX loads; the CLI silences native code's descriptors.
"""

from __future__ import annotations

import logging
import os
import threading

from qconvert import interrupts
from qconvert.cluster import rendezvous
from qconvert.cluster.launchers import Place, launched_by, place_as_jax_detects, place_from_environment
from qconvert.cluster.runtime import Launch, _state, check_launch
from qconvert.cluster.settings import command_settings
from qconvert.formats.errors import ClusterError, UsageError

# Seconds the processes wait for one another to join, qconvert's own deadline (QCONVERT_JOIN_TIMEOUT).
JOIN_TIMEOUT_S = 120
JOIN_TIMEOUT_VARIABLE = "QCONVERT_JOIN_TIMEOUT"
# jax.distributed's initialization_timeout is this much later than qconvert's: qconvert's acts first.
JAX_LATER_S = 60
# jax.distributed's own heartbeat timeout: on a miss it ends the process from C++ with no cleanup, so it is set
# well past the run's own watch (qconvert.cluster.watch.PEER_TIMEOUT_S), which acts first and cleans up.
HEARTBEAT_TIMEOUT_S = 600
# Native log levels, set (where the user set none) before JAX and gRPC load.
NATIVE_LOG_LEVELS = (("GRPC_VERBOSITY", "NONE"), ("GLOG_minloglevel", "3"), ("TF_CPP_MIN_LOG_LEVEL", "3"),
                     ("ABSL_MIN_LOG_LEVEL", "3"))


def join_timeout(environ=os.environ) -> float:
    """Seconds the processes wait for one another to join: QCONVERT_JOIN_TIMEOUT, else JOIN_TIMEOUT_S (read
    here only; UsageError for a value that is not a number of seconds in 1..86400)."""
    text = environ.get(JOIN_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return float(JOIN_TIMEOUT_S)
    try:
        value = float(text) if text.isascii() else float("nan")
    except ValueError:
        value = float("nan")
    if not 1 <= value <= 86400:
        raise UsageError(f"{JOIN_TIMEOUT_VARIABLE}={text!r} is not a number of seconds in 1..86400")
    return value


def place_of(launch: Launch) -> Place | None:
    """This process's place in the run (None: a run of one process)."""
    if launch.flagged:
        if launch.num_processes == 1:
            return None
        return Place("--coordinator", launch.coordinator, launch.num_processes, launch.process_id)
    if launch.detect:
        quiet_native_logs()  # JAX's detection loads JAX
        return place_as_jax_detects(int(join_timeout()))
    if launched_by(os.environ) is None:
        return None
    return place_from_environment(os.environ)


def start(launch: Launch, before_joining=None, report=None) -> None:
    """Join the run's other processes (call before JAX starts a backend); one process: nothing happens.

    `before_joining()` runs first when there is a run to join (the CLI keeps native output off stdout and
    stderr); `report(line, code)` is how this process says a failure where a thread ends it (the --json
    document of process 0)."""
    check_launch(launch)
    place = place_of(launch)
    if place is None or place.count == 1:
        return
    timeout_s = join_timeout()
    quiet_native_logs()
    if report is not None:
        interrupts.add_last_words(report)
    if before_joining is not None:
        before_joining()
    joined = rendezvous.join(place, command_settings(), timeout_s)
    from qconvert.cluster.watch import Watch

    _state.index, _state.count = joined.index, joined.count
    _state.watch = Watch.start(joined)
    _state.held = joined.held
    _state.active = True
    interrupts.add_last_words(_state.watch.tell)
    _start_jax(place, joined, timeout_s)
    interrupts.reinstall()


def quiet_native_logs() -> None:
    """gRPC's, absl's and XLA's log levels, set before JAX loads them, and the Python loggers of JAX's join."""
    for name, value in NATIVE_LOG_LEVELS:
        os.environ.setdefault(name, value)
    for name in ("jax._src.distributed", "jax._src.clusters"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _start_jax(place: Place, joined, timeout_s: float) -> None:
    """jax.distributed, its service on the port process 0 chose, under qconvert's deadline."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes reduce over gloo
    jax.config.update("jax_enable_preemption_service", False)  # its notifier would take SIGTERM from qconvert
    host, _ = rendezvous.split_address(place.coordinator)
    service = f"{host}:{joined.service_port}"
    stalled = threading.Timer(timeout_s, _stalled, args=(f"jax.distributed did not start within {timeout_s:g} s "
                                                         f"(process 0's service at {service})",))
    stalled.daemon = True
    stalled.start()
    try:
        jax.distributed.initialize(service, joined.count, joined.index,
                                   initialization_timeout=int(timeout_s) + JAX_LATER_S,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   coordinator_bind_address=f"[::]:{joined.service_port}")
    except Exception as err:  # noqa: BLE001 - jax raises RuntimeError, ValueError or its own XlaRuntimeError
        text = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ClusterError(f"cannot join the run's processes ({place.said_by}): {text}") from None
    finally:
        stalled.cancel()


def _stalled(line: str) -> None:
    """End this process from the deadline's thread, as the watch ends it (temporaries, the others told)."""
    from qconvert.cluster.watch import end_from_thread

    end_from_thread((ClusterError.exit_code, _state.index, line))
