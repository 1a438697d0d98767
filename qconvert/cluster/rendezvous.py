"""qconvert's own join, over plain sockets, before jax.distributed starts: nothing native waits, times out or
aborts while the processes find one another.

Process 0 binds the coordinator's port and holds it for the whole run (a taken port is refused at once; a
second run on the same port cannot start, and its processes are turned away). Every other process connects to
it, retrying until the join's deadline, and says hello: the word `qconvert-join`, its process id, the count it
was started with and its run's settings. Process 0 waits, up to the same deadline, for one hello from each
process id, and checks them: a duplicate id, another count or other settings refuse the run, and every process
that joined leaves with the same line and code. Then it picks a free port for jax.distributed's service and
welcomes each process with it. The connections stay open: they are the run's watch (qconvert.cluster.watch).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from qconvert.cluster.launchers import Place
from qconvert.cluster.settings import first_difference
from qconvert.formats.errors import ClusterError, QConvertError, UsageError

WORD = "qconvert-join"
LINE_LIMIT = 1 << 20   # a hello's settings, JSON
HELLO_S = 10.0         # how long an accepted connection has to say hello
RETRY_S = 0.2          # between a process's tries to reach process 0


@dataclasses.dataclass
class Joined:
    """The run, once every process is in: this process's peers (process 0: every other; others: {0: ...}),
    the port jax.distributed's service listens on, and (process 0) the held coordinator socket."""

    index: int
    count: int
    peers: dict[int, socket.socket]
    service_port: int
    held: socket.socket | None = None


def join(place: Place, settings: Mapping[str, Any], timeout_s: float) -> Joined:
    """Join the run as `place` says, within `timeout_s` (ClusterError, exit 10: a process missing, a duplicate
    id, process 0 unreachable or not qconvert; UsageError, exit 2: other settings than process 0's)."""
    host, port = split_address(place.coordinator)
    hello = {"kind": WORD, "process": place.index, "count": place.count, "settings": dict(settings)}
    if place.index == 0:
        return _lead(place, port, hello, timeout_s)
    return _follow(place, host, port, hello, timeout_s)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def hold_port(port: int) -> socket.socket:
    """The coordinator's port, bound and listening on every address of this host (ClusterError at once where
    another program holds it)."""
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        return socket.create_server(("", port), backlog=64)
    except OSError as err:
        why = ("another program (or another run) listens there" if err.errno == errno.EADDRINUSE
               else err.strerror or str(err))
        raise ClusterError(f"the coordinator port {port} is taken on this host: {why}; give --coordinator a free "
                           "port") from None


def _lead(place: Place, port: int, hello: dict, timeout_s: float) -> Joined:
    server = hold_port(port)
    deadline = time.monotonic() + timeout_s
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < place.count - 1:
            conn = _accept(server, deadline, place, peers, timeout_s)
            theirs = _hello_of(conn)
            if theirs is None:
                conn.close()  # not a qconvert process: it is not one of the run's
                continue
            refusal = _refusal(theirs, hello, peers)
            if refusal is not None:
                _refuse([*peers.values(), conn], refusal)
                raise refusal
            peers[int(theirs["process"])] = conn
        service_port = free_port()
        for process, conn in peers.items():
            try:
                _send(conn, {"kind": "welcome", "service_port": service_port})
            except OSError:
                raise ClusterError(f"process {process} of {place.count} stopped while the run was joining "
                                   "(killed, or its host gone)") from None
    except BaseException as err:
        if isinstance(err, QConvertError):
            _refuse(list(peers.values()), err)
        else:  # a signal, or a failure of qconvert's own: the others hear why
            from qconvert import interrupts

            code = interrupts.exit_code_for(err) if isinstance(err, (KeyboardInterrupt, interrupts.Interrupted)) else 70
            _refuse(list(peers.values()), ClusterError(f"process 0 failed: {interrupts.message_for(err)}"
                                                       if code != 70 else "process 0 failed while joining"), code)
        server.close()
        raise
    threading.Thread(target=_turn_away, args=(server,), daemon=True, name="qconvert-coordinator").start()
    return Joined(0, place.count, peers, service_port, server)


def _accept(server: socket.socket, deadline: float, place: Place, peers: Mapping[int, socket.socket],
            timeout_s: float) -> socket.socket:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [str(p) for p in range(1, place.count) if p not in peers]
            raise ClusterError(f"process{'es' if len(missing) > 1 else ''} {', '.join(missing)} of {place.count} "
                               f"did not join within {timeout_s:g} s (not started, or given another coordinator "
                               f"than {place.coordinator})")
        server.settimeout(min(remaining, 1.0))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(max(0.1, min(deadline - time.monotonic(), HELLO_S)))
        return conn


def _hello_of(conn: socket.socket) -> dict | None:
    """A qconvert process's hello, or None for anything else (silence, other bytes, a closed connection)."""
    try:
        message = _read(conn)
    except (OSError, ValueError):
        return None
    if message is None or message.get("kind") != WORD or not isinstance(message.get("process"), int):
        return None
    return message


def _refusal(theirs: dict, mine: dict, peers: Mapping[int, socket.socket]) -> QConvertError | None:
    """Why process 0 refuses the run on a hello (None: the process is in)."""
    process, count = theirs["process"], theirs.get("count")
    if count != mine["count"]:
        return UsageError(f"process {process} was started with --num-processes {count!r}, process 0 with "
                          f"{mine['count']}; start every process with the same flags")
    if process in peers or process == 0 or not 0 < process < mine["count"]:
        return ClusterError(f"two processes were started as process {process} of {mine['count']} (each needs its "
                            f"own --process-id, 0..{mine['count'] - 1})")
    differs = first_difference(mine["settings"], theirs.get("settings") or {})
    if differs is not None:
        key, their_value, my_value = differs
        return UsageError(f"process {process} was started with {key} {their_value!r}, process 0 with {my_value!r}; "
                          "start every process with the same flags")
    return None


def _refuse(conns, err: QConvertError, code: int | None = None) -> None:
    for conn in conns:
        try:
            _send(conn, {"kind": "refuse", "code": err.exit_code if code is None else code, "line": str(err)})
        except OSError:
            pass
        conn.close()


def _turn_away(server: socket.socket) -> None:
    """Process 0, for the rest of the run: a process that comes late (another run's, given the same
    coordinator) is refused, not left waiting."""
    server.settimeout(None)
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        conn.settimeout(HELLO_S)
        _refuse([conn], ClusterError("the run at this coordinator has already started (another run given the "
                                     "same --coordinator?); give each run its own port"))


def _follow(place: Place, host: str, port: int, hello: dict, timeout_s: float) -> Joined:
    deadline = time.monotonic() + timeout_s
    conn = _connect(host, port, deadline, timeout_s)
    try:
        _send(conn, hello)
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            reply = _read(conn)
        except TimeoutError:
            raise ClusterError(f"{host}:{port} did not answer as qconvert's process 0 within {timeout_s:g} s "
                               "(another program listens there?)") from None
        except (OSError, ValueError):
            reply = {}
        if reply is None:
            raise ClusterError(f"{host}:{port} closed the connection without answering as qconvert's process 0 "
                               "(another program listens there?)")
        if reply.get("kind") == "refuse":
            err = QConvertError(str(reply.get("line", "process 0 refused the run")))
            err.exit_code = int(reply.get("code", ClusterError.exit_code))
            raise err
        if reply.get("kind") != "welcome" or not isinstance(reply.get("service_port"), int):
            raise ClusterError(f"{host}:{port} is not qconvert's process 0 (it answered something else)")
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return Joined(place.index, place.count, {0: conn}, int(reply["service_port"]))


def _connect(host: str, port: int, deadline: float, timeout_s: float) -> socket.socket:
    """A connection to process 0, tried until the deadline (it may not have started yet)."""
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError as err:
            if time.monotonic() + RETRY_S >= deadline:
                raise ClusterError(f"cannot reach process 0 at {host}:{port} within {timeout_s:g} s "
                                   f"({err.strerror or err}); start process 0, with the same --coordinator") from None
            time.sleep(RETRY_S)


def free_port() -> int:
    """A port free on this host for jax.distributed's service (all addresses, as it binds)."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message, sort_keys=True, default=str).encode() + b"\n")


def _read(conn: socket.socket) -> dict | None:
    """One JSON line, and not a byte past it (the connection goes on as the watch's); None: the connection
    closed first; ValueError for anything else."""
    data = b""
    while True:
        chunk = conn.recv(65536, socket.MSG_PEEK)
        if not chunk:
            if data:
                raise ValueError("a partial line")
            return None
        end = chunk.find(b"\n")
        data += conn.recv(len(chunk) if end < 0 else end + 1)
        if len(data) > LINE_LIMIT:
            raise ValueError("a line too long")
        if end >= 0:
            break
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not a message")
    return message
