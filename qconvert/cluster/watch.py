"""The run's watch: every process knows within a bounded time when another has failed or vanished, and all end
with one exit code.

Every other process keeps the connection to process 0 that joined it to the run
(qconvert.cluster.rendezvous). Each side pings every PING_S seconds. A process that ends (success or failure)
says `done` with its exit code and its line, then waits for process 0's `end`: the run's exit code, that of the
first process (in process order) that failed, or 0. A connection that closes without `done` (a process killed,
out of memory, its host gone) or stays silent for PEER_TIMEOUT_S, and a `done` with a failure while the others
still work, end the run at once: each process removes its temporaries (interrupts' registry), prints one line
naming the process, and exits with the run's code. A process blocked inside a collective is ended from the
watch's thread; jax.distributed's own, later, heartbeat timeout never has to.
"""

from __future__ import annotations

import json
import socket
import threading
import time

from qconvert import interrupts
from qconvert.formats.errors import ClusterError

PING_S = 5.0
PEER_TIMEOUT_S = 60.0   # a process silent this long is taken as gone
FAREWELL_S = 5.0        # how long process 0 waits for the others to leave after `end`


class Watch:
    """This process's side of the watch (see the module's doc)."""

    def __init__(self, index: int, count: int):
        self.index, self.count = index, count
        self.lock = threading.Condition()
        self.peers: dict[int, socket.socket] = {}   # process 0: each other process; others: {0: process 0}
        self.outcomes: dict[int, tuple[int, str]] = {}
        self.final: tuple[int, int, str] | None = None  # (exit code, process, line)
        self.finishing = False
        self.failing = False  # this process's main thread is reporting its own failure (it then says `done`)
        self.sending = threading.Lock()  # the ping thread and the main thread share each connection

    # -- joining ---------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, joined) -> "Watch":
        """The watch over the connections the join left open (qconvert.cluster.rendezvous.Joined), its threads
        started: from now on a process that vanishes, even inside jax.distributed's start, ends the run."""
        watch = cls(joined.index, joined.count)
        watch.peers = dict(joined.peers)
        for peer, conn in watch.peers.items():
            conn.settimeout(PEER_TIMEOUT_S)
            threading.Thread(target=watch._listen, args=(peer, conn), daemon=True,
                             name=f"qconvert-watch-{peer}").start()
        threading.Thread(target=watch._ping, daemon=True, name="qconvert-watch-ping").start()
        return watch

    def tell(self, line: str, code: int) -> None:
        """This process is being ended from a thread (a signal's watchdog) with `code`: the others hear it as
        this process's failure (process 0 ends the run with it) instead of a connection gone without a word."""
        with self.lock:
            if self.final is not None:
                return
        if self.index == 0:
            with self.lock:
                self.final = (code, 0, line)
            self._broadcast_end()
        else:
            try:
                self._send(self.peers[0], {"kind": "done", "code": code, "line": line})
            except OSError:
                pass

    # -- the threads -----------------------------------------------------------------------------------------

    def _ping(self) -> None:
        while True:
            time.sleep(PING_S)
            for conn in list(self.peers.values()):
                try:
                    self._send(conn, {"kind": "ping"})
                except OSError:
                    pass  # the listener sees the connection end

    def _listen(self, peer: int, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        while True:
            try:
                message = _read_line(stream)
            except (OSError, ValueError):
                message = None
            if message is None:
                break
            kind = message.get("kind")
            if kind == "done" and self.index == 0:
                self._done(peer, int(message["code"]), str(message.get("line", "")))
            elif kind == "end" and self.index != 0:
                self._decided((int(message["code"]), int(message["process"]), str(message.get("line", ""))))
                return
        # The connection ended (or was silent PEER_TIMEOUT_S) before the run's end.
        with self.lock:
            said = peer in self.outcomes or self.final is not None
        if not said:
            self._decided((ClusterError.exit_code, peer,
                           f"process {peer} of {self.count} stopped without a word (killed, out of memory, or its "
                           "host gone)"))

    def _done(self, peer: int, code: int, line: str) -> None:
        """Process 0 hears that `peer` ended with `code`."""
        with self.lock:
            self.outcomes[peer] = (code, line)
            self.lock.notify_all()
        if code != 0:
            self._decided((code, peer, line))

    def _decided(self, final: tuple[int, int, str]) -> None:
        """The run's outcome is known: tell the others (process 0), and end this process unless it is itself
        finishing (its main thread then reports it)."""
        with self.lock:
            if self.final is not None:
                return
            self.final = final
            finishing = self.finishing or self.failing
            self.lock.notify_all()
        if self.index == 0:
            self._broadcast_end()
        if not finishing:
            end_from_thread(final)

    def _broadcast_end(self) -> None:
        code, process, line = self.final
        for conn in self.peers.values():
            try:
                self._send(conn, {"kind": "end", "code": code, "process": process, "line": line})
            except OSError:
                pass

    def _send(self, conn: socket.socket, message: dict) -> None:
        with self.sending:
            conn.sendall(json.dumps(message).encode() + b"\n")

    # -- the main thread -------------------------------------------------------------------------------------

    def finish(self, code: int, line: str) -> tuple[int, int, str]:
        """This process ended with `code` (and `line`, its error line): the run's (code, process, line)."""
        with self.lock:
            self.finishing = True
            decided = self.final
        if decided is not None:
            if self.index == 0:
                self._farewell()
            return decided
        if self.index == 0:
            self._done(0, code, line)
            with self.lock:
                while self.final is None and len(self.outcomes) < self.count:
                    self.lock.wait(1.0)
                decided_here = self.final is None
                if decided_here:
                    self.final = (0, 0, "")
            if decided_here:
                self._broadcast_end()
            self._farewell()
            return self.final
        try:
            self._send(self.peers[0], {"kind": "done", "code": code, "line": line})
        except OSError:
            pass  # the listener sees process 0 gone
        with self.lock:
            while self.final is None:
                self.lock.wait(1.0)
            return self.final

    def _farewell(self) -> None:
        """Process 0 leaves last: the others' jax.distributed clients end before its service does."""
        deadline = time.monotonic() + FAREWELL_S
        for conn in self.peers.values():
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while conn.recv(4096):
                    pass
            except OSError:
                pass

    def failed_elsewhere(self, wait_s: float) -> bool:
        """Whether another process's failure decides the run (waiting up to `wait_s` for the watch to hear of
        one): a collective that failed here is then its echo, and the watch ends this process."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while self.final is None and time.monotonic() < deadline:
                self.lock.wait(0.1)
            return self.final is not None and self.final[1] != self.index


def failure_text(final: tuple[int, int, str]) -> str:
    """The line (without `qconvert: error: `) that names the process whose failure decided the run."""
    _, process, line = final
    return line if line.startswith(f"process {process} ") else f"process {process} failed: {line}"


def end_from_thread(final: tuple[int, int, str]) -> None:
    """End this process from the watch's thread: temporaries removed, one line, the run's exit code."""
    if not interrupts.claim_exit():
        return  # a signal's exit is under way
    interrupts.end_from_thread(failure_text(final), final[0])


def _read_line(stream) -> dict | None:
    line = stream.readline()
    if not line:
        return None
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("not a message")
    return message
