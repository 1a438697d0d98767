"""How the pipeline reports what it is doing: lines, and counted steps of named stages.

The math calls a Reporter and never draws anything: the CLI hands in a
terminal one (qconvert.cli.console.RichStages: a bar with an ETA per stage, on
stderr), a plain one for logs and pipes (Lines), or none (-q, --json). A stage
is only a name: a new one (GPTQ, say) is one more `step` call in its loop, with
no change here or in the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Reporter(Protocol):
    """Receives the pipeline's progress."""

    def __call__(self, line: str) -> None:
        """A line for the user (what is about to run, a choice that was made)."""

    def step(self, stage: str, done: int, total: int, unit: str = "layers") -> None:
        """`done` of `total` steps of `stage` are finished (called with done = 0 as the stage starts)."""


class Silent:
    """Reports nothing (-q, --json, library callers)."""

    def __call__(self, line: str) -> None:
        del line

    def step(self, stage: str, done: int, total: int, unit: str = "layers") -> None:
        del stage, done, total, unit


class Lines:
    """Plain lines for logs and pipes: every message, and a stage's count at most every `every` seconds
    (always its first and last step), so a slow stage shows it is alive without flooding the log.

    A finished stage's "in X s" is its own time: stages that run together (calibrating, AWQ and GPTQ take turns
    layer by layer) each count the time since the step before theirs, of whatever stage, so their figures add up
    to the run's time instead of each reading as the whole of it."""

    def __init__(self, write: Callable[[str], None], every: float = 10.0, clock=time.monotonic):
        self._write, self._every, self._clock = write, every, clock
        self._spent: dict[str, float] = {}  # each running stage's own seconds so far
        self._last: dict[str, float] = {}  # when each running stage last wrote its count
        self._previous = 0.0  # the last step of any stage

    def __call__(self, line: str) -> None:
        self._write(line)

    def step(self, stage: str, done: int, total: int, unit: str = "layers") -> None:
        now = self._clock()
        if done == 0 or stage not in self._spent:  # started now: nothing before counts as its work
            self._spent[stage], self._last[stage] = 0.0, now
        else:
            self._spent[stage] += now - self._previous
        self._previous = now
        if done == 0:
            return
        if done >= total:
            self._last.pop(stage)
            self._write(f"{stage}: {done}/{total} {unit} in {self._spent.pop(stage):.1f} s")
        elif now - self._last[stage] >= self._every:
            self._last[stage] = now
            self._write(f"{stage}: {done}/{total} {unit}")


SILENT = Silent()


def as_reporter(progress: Reporter | Callable[[str], None] | None) -> Reporter:
    """A Reporter from what a caller handed in: None reports nothing, a bare callable gets lines only."""
    if progress is None:
        return SILENT
    if hasattr(progress, "step"):
        return progress
    return Lines(progress)
