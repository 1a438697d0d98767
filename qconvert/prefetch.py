"""Run a sequence of tasks on a worker thread ahead of their consumer, holding a bounded number of bytes.

The conversion reads and quantizes tensor k+1 while tensor k is being written and
hashed: file reads, XLA and hashlib all release the GIL, so on two or more cores
the two overlap. Results come out in task order, so the output bytes do not depend
on the timing.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from qconvert import interrupts

T = TypeVar("T")


class _Cancelled(Exception):
    """The consumer stopped early; the worker leaves its loop."""


class _Window(Generic[T]):
    """The finished tasks not yet consumed, and the bytes they (and the one being consumed) hold."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.ready: collections.deque[tuple[int, list[T]]] = collections.deque()
        self.held = 0
        self.done = False
        self.cancelled = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def wait_for_room(self, cost: int) -> None:
        """Block the worker until `cost` more bytes fit (or nothing is held at all)."""
        with self.cond:
            while not self.cancelled and self.held and self.held + cost > self.limit_bytes:
                self.cond.wait()
            if self.cancelled:
                raise _Cancelled
            self.held += cost

    def put(self, cost: int, results: list[T]) -> None:
        with self.cond:
            self.ready.append((cost, results))
            self.cond.notify_all()

    def finish(self, error: BaseException | None) -> None:
        with self.cond:
            self.done, self.error = True, error
            self.cond.notify_all()

    def take(self) -> tuple[int, list[T]] | None:
        """The next finished task, waiting for it; None after the last one. Re-raises a worker's error."""
        with self.cond:
            while not self.ready and not self.done:
                self.cond.wait()
            if self.ready:
                return self.ready.popleft()
            if self.error is not None:
                raise self.error
            return None

    def release(self, cost: int) -> None:
        with self.cond:
            self.held -= cost
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()


def run_ahead(tasks: Iterable[tuple[int, Callable[[], list[T]]]], limit_bytes: int,
              on_done: Callable[[int], None] | None = None) -> Iterator[T]:
    """Yield the results of `tasks` ((cost in bytes, fn returning a list of results)) in order.

    A worker thread runs the tasks ahead while the caller consumes earlier results.
    A task's cost counts from before it runs until the caller asks for the first
    result after its own (the caller is then done with them); the worker starts a
    task only while the counted bytes plus its cost stay within `limit_bytes`, or
    when nothing is counted. `on_done(cost)` is called in the caller's thread once
    a task's results have all been consumed. An exception in a task (KeyboardInterrupt
    included) is raised in the caller after the results of the tasks before it;
    if the caller stops early, the worker stops after its current task.
    """
    window: _Window[T] = _Window(limit_bytes)

    def work() -> None:
        try:
            for cost, fn in tasks:
                window.wait_for_room(cost)
                window.put(cost, fn())
        except _Cancelled:
            window.finish(None)
        except BaseException as err:  # handed to the consumer, which raises it
            window.finish(err)
        else:
            window.finish(None)

    worker = threading.Thread(target=work, name="qconvert-prefetch", daemon=True)
    worker.start()
    try:
        while (item := window.take()) is not None:
            cost, results = item
            del item
            while results:
                yield results.pop(0)  # the list lets go of each result once it is handed out
            window.release(cost)
            if on_done is not None:
                on_done(cost)
            interrupts.check()  # a signal that a callee swallowed still stops the stream
    finally:
        window.cancel()
        worker.join()
