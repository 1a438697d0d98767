"""What the processes of a run must agree on, derived from what the command declares, never from a list kept by
hand: every option of the command (its click parameters: a flag added later is compared too), and every field
of the conversion's options object (qconvert.options.ConvertOptions, its calibration's fields within).

Left out, because each process may hold its own: the positional arguments (MODEL, or the folder verify reads:
each host may read its own copy, whose files the run compares by sha256), the flags that place a process in
the run (--coordinator, --num-processes, --process-id, --cluster: the join compares the count itself), and the
flags that change only what a process prints (--quiet, --verbose: only process 0 prints).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PER_PROCESS = frozenset({"coordinator", "num_processes", "process_id", "detect_cluster", "quiet", "verbose"})


def first_difference(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first setting (in `mine`'s order, then any other by name) that differs: (name, theirs, mine)."""
    for key in [*mine, *sorted(set(theirs) - set(mine))]:
        if key not in mine or key not in theirs or mine[key] != theirs[key]:
            return key, theirs.get(key), mine.get(key)
    return None


def plain(value: Any) -> Any:
    """A setting as the same JSON on every process (paths and tuples as strings and lists)."""
    return json.loads(json.dumps(value, default=str))


def flag_of(param) -> str:
    """How the user spells a click option: its long name (`--dry-run`)."""
    names = sorted(param.opts, key=lambda o: (not o.startswith("--"), -len(o)))
    return names[0] if names else str(param.name)


def command_settings() -> dict[str, Any]:
    """The running command's settings: its name, qconvert's version and every option it was given or
    defaulted, by flag, in the order the command declares them ({} outside a click command)."""
    import click

    from qconvert import __version__

    ctx = click.get_current_context(silent=True)
    if ctx is None or ctx.command is None:
        return {}
    settings: dict[str, Any] = {"the command": ctx.command.name, "qconvert version": __version__}
    for param in ctx.command.params:
        if isinstance(param, click.Argument) or param.name in PER_PROCESS:
            continue
        settings[flag_of(param)] = plain(ctx.params.get(param.name))
    return settings


def options_settings(options, out: Path | None = None, renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A conversion's settings: every field of its options object (a dataclass; a nested one's fields by their
    own names), in declaration order, each by its flag (`renamed`: a field whose flag has another name), and
    OUT."""
    renamed = dict(renamed or {})
    settings: dict[str, Any] = {} if out is None else {"--out": str(out)}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if dataclasses.is_dataclass(value):
            settings.update(options_settings(value, renamed=renamed))
            continue
        settings["--" + renamed.get(field.name, field.name).replace("_", "-")] = plain(value)
    return settings
