"""The click types of every flag and argument: each hands its value to qconvert.formats.outside's checks.

A test walks every command's parameters and holds each to one of these (or a choice, or an on/off flag), so a
new flag cannot take a value from outside unchecked.
"""

from __future__ import annotations

import click

from qconvert.formats import outside


class _Checked(click.ParamType):
    """A flag's value passed through one of qconvert.formats.outside's checks; its refusal is click's usage error."""

    def check(self, value, what: str):
        raise NotImplementedError

    def convert(self, value, param, ctx):
        what = param.get_error_hint(ctx) if param is not None and ctx is not None else self.name
        try:
            return self.check(value, what)
        except outside.OutsideValueError as err:
            self.fail(str(err).removeprefix(what).strip(), param, ctx)


class WholeNumber(_Checked):
    """A whole number in ASCII digits, within [low, high]."""

    name = "integer"

    def __init__(self, low: int | None = None, high: int | None = None):
        self.low, self.high = low, high

    def check(self, value, what: str):
        return outside.whole_number(value, what, low=self.low, high=self.high)


class RealNumber(_Checked):
    """A finite number in ASCII digits, within [low, high]."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None):
        self.low, self.high = low, high

    def check(self, value, what: str):
        return outside.real_number(value, what, low=self.low, high=self.high)


class Text(_Checked):
    """Text without control characters, UTF-8, bounded; a blank one is refused unless `empty` (the flag's own
    check then says what a blank value means)."""

    name = "text"

    def __init__(self, *, empty: bool = False):
        self.empty = empty

    def check(self, value, what: str):
        return outside.text(value, what, empty=self.empty)


class LocalPath(_Checked):
    """A local path: UTF-8, no control characters, names within NAME_MAX; `exists`: it must be there, as a
    file (`file_okay`) or a folder (`dir_okay`)."""

    name = "path"

    def __init__(self, *, exists: bool = False, file_okay: bool = True, dir_okay: bool = True):
        self.exists, self.file_okay, self.dir_okay = exists, file_okay, dir_okay

    def check(self, value, what: str):
        found = outside.path(value, what)
        if not self.exists:
            return found
        if not found.exists():
            raise outside.refuse(what, f"{outside.shown(found)} does not exist")
        if found.is_dir() and not self.dir_okay:
            raise outside.refuse(what, f"{outside.shown(found)} is a folder, not a file")
        if not found.is_dir() and not self.file_okay:
            raise outside.refuse(what, f"{outside.shown(found)} is not a folder")
        return found



class ByteSize(_Checked):
    """A size in bytes: a number and an optional unit (5GiB, 500MB)."""

    name = "size"

    def check(self, value, what: str):
        return value if isinstance(value, int) else outside.byte_size(value, what)


class Source(_Checked):
    """MODEL: a Hub id or a local folder, as text a path check accepts (UTF-8, no control characters, names within
    NAME_MAX); where it is a local path, every folder on its way must have a UTF-8 name too (the card and
    qconvert.json record it)."""

    name = "model"

    def check(self, value, what: str):
        if isinstance(value, str) and not value.strip():
            return value  # MODEL's own check says what an empty MODEL is not (the current folder)
        found = outside.path(value, what)
        local = found.expanduser()
        if local.exists():
            outside.folder_names(local.resolve(), what)
        return str(value)


class Output(LocalPath):
    """-o OUT: a path whose parent folders have UTF-8 names too (OUT's own path is recorded in documents)."""

    name = "out"

    def check(self, value, what: str):
        found = outside.path(value, what)
        outside.folder_names(found.expanduser().absolute(), what)
        return found


# The types a parameter may have besides these: a choice among fixed words, an on/off flag.
FIXED_TYPES = (click.Choice, click.types.BoolParamType)
CHECKED_TYPES = (WholeNumber, RealNumber, Text, LocalPath, Source, ByteSize)
