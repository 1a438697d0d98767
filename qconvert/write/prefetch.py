"""Run a sequence of tasks on worker threads ahead of their consumer, holding a bounded number of bytes.

The conversion reads and quantizes the next tensors while earlier ones are being
written and hashed: file reads, XLA, numpy and hashlib all release the GIL, so on
several cores they overlap. Tasks start in order (each reserves its bytes before
it runs), may finish in any order, and their results come out in task order, so
the output bytes do not depend on the timing or on the number of workers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from qconvert import interrupts

T = TypeVar("T")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


WORKERS_PER_CORE = 4  # past this, threads only add memory and contention (bench/workers_sweep.py)


def max_workers() -> int:
    """The most --workers a conversion takes: 4 threads per core the process may use."""
    return WORKERS_PER_CORE * available_cores()


class _Cancelled(Exception):
    """The consumer stopped early (or a task failed); the workers leave their loops."""


class _Window(Generic[T]):
    """Tasks started and not yet consumed: their results by index, and the bytes they hold."""

    def __init__(self, limit_bytes: int, workers: int):
        self.limit_bytes = limit_bytes
        self.results: dict[int, tuple[int, list[T] | None, BaseException | None]] = {}
        self.held = 0
        self.running = workers  # workers not yet finished
        self.last: int | None = None  # the number of tasks, once the source is exhausted
        self.cancelled = False
        self.cond = threading.Condition()

    def reserve(self, cost: int) -> None:
        """Block until `cost` more bytes fit (or nothing is held at all); called in task order."""
        with self.cond:
            while not self.cancelled and self.held and self.held + cost > self.limit_bytes:
                self.cond.wait()
            if self.cancelled:
                raise _Cancelled
            self.held += cost

    def put(self, index: int, cost: int, results: list[T] | None, error: BaseException | None) -> None:
        with self.cond:
            self.results[index] = (cost, results, error)
            if error is not None:
                self.cancelled = True  # no task after a failed one starts
            self.cond.notify_all()

    def exhausted(self, count: int) -> None:
        with self.cond:
            self.last = count if self.last is None else min(self.last, count)
            self.cond.notify_all()

    def worker_done(self) -> None:
        with self.cond:
            self.running -= 1
            self.cond.notify_all()

    def take(self, index: int) -> tuple[int, list[T]] | None:
        """Task `index`'s results, waiting for them; None after the last task. Re-raises a task's error."""
        with self.cond:
            while index not in self.results:
                if (self.last is not None and index >= self.last) or not self.running:
                    return None
                self.cond.wait()
            cost, results, error = self.results.pop(index)
            if error is not None:
                raise error
            return cost, results

    def release(self, cost: int) -> None:
        with self.cond:
            self.held -= cost
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()


def run_ahead(tasks: Iterable[tuple[int, Callable[[], list[T]]]], limit_bytes: int,
              on_done: Callable[[int], None] | None = None, workers: int = 1) -> Iterator[T]:
    """Yield the results of `tasks` ((cost in bytes, fn returning a list of results)) in order.

    `workers` threads run the tasks ahead while the caller consumes earlier results.
    A task's cost counts from before it runs until the caller asks for the first
    result after its own (the caller is then done with them); a task starts only
    while the counted bytes plus its cost stay within `limit_bytes`, or when nothing
    is counted. `on_done(cost)` is called in the caller's thread once a task's
    results have all been consumed. An exception in a task (KeyboardInterrupt
    included) is raised in the caller after the results of the tasks before it, and
    no later task starts; if the caller stops early, the workers stop after their
    current tasks.
    """
    window: _Window[T] = _Window(limit_bytes, max(1, workers))
    source = _TaskSource(tasks, window)
    threads = [threading.Thread(target=source.work, name="qconvert-prefetch", daemon=True)
               for _ in range(max(1, workers))]
    for thread in threads:
        thread.start()
    try:
        index = 0
        while (item := window.take(index)) is not None:
            cost, results = item
            del item
            while results:
                yield results.pop(0)  # the list lets go of each result once it is handed out
            window.release(cost)
            if on_done is not None:
                on_done(cost)
            index += 1
            interrupts.check()  # a signal that a callee swallowed still stops the stream
    finally:
        window.cancel()
        for thread in threads:
            thread.join()


class _TaskSource:
    """run_ahead's tasks, taken in order by the worker threads: taking the next task and reserving its bytes
    happen under one lock, in task order."""

    def __init__(self, tasks: Iterable[tuple[int, Callable[[], list]]], window: "_Window"):
        self._tasks, self._window = enumerate(tasks), window
        self._lock = threading.Lock()
        self._taken = 0

    def work(self) -> None:
        """One worker thread: run tasks until none is left, one fails, or the consumer cancels."""
        window = self._window
        try:
            while (task := self._next()) is not None:
                index, cost, fn = task
                try:
                    results, error = fn(), None
                except BaseException as err:  # handed to the consumer, which raises it
                    results, error = None, err
                window.put(index, cost, results, error)
                del results
                if error is not None:
                    return
        except _Cancelled:
            pass
        except BaseException as err:  # the task source itself failed: the consumer raises it in order
            with self._lock:
                window.put(self._taken, 0, None, err)
        finally:
            window.worker_done()

    def _next(self) -> tuple[int, int, Callable[[], list]] | None:
        with self._lock:
            item = next(self._tasks, None)
            if item is None:
                self._window.exhausted(self._taken)
                return None
            index, (cost, fn) = item
            self._taken = index + 1
            self._window.reserve(cost)
            return index, cost, fn
