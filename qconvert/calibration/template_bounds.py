"""Bounds on one rendering of a chat template: the text it writes and the time it takes.

A chat template is a checkpoint's code. jinja2's sandbox keeps it from Python's internals, not from writing
without end: nested loops, a string repeated or doubled, a width of a billion. Here a rendering stops, with
TemplateBoundError, once it has written MAX_TEXT_BYTES (counted as UTF-8 at every level: the rows it streams, and
what it writes into a `{% set %}` block, a macro or a filter block on the way), or once a value it builds
(a repeated, added, joined or formatted string or list, an integer power) would pass that size, or after
MAX_SECONDS (an exception raised into the rendering thread, so a loop that writes nothing stops too).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import re
import threading
import time
from typing import Any

# One row's text is cut into windows of --calib-seqlen tokens: 64 MiB is some 16 million tokens.
MAX_TEXT_BYTES = 64 * 2**20
MAX_SECONDS = 10.0
# An integer a template computes: at most this many bits (a power or product past it is refused, not computed).
MAX_INT_BITS = 1 << 16
_NUMBER = re.compile(r"\d+")


class TemplateBoundError(Exception):
    """A rendering passed one of the bounds; the message says which."""


class _Timeout(BaseException):
    # Raised into the rendering thread when its time is up; a BaseException, so no `except Exception` in the
    # template's runtime swallows it.
    pass


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _too_big(what: str) -> TemplateBoundError:
    return TemplateBoundError(f"{what} would pass {MAX_TEXT_BYTES // 2**20} MiB, the most one row may take")


class _Rendering(threading.local):
    written = 0
    deadline = math.inf


class BoundedEnvironmentMixin:
    """What a jinja2 environment adds to bound its renderings (mixed into the sandboxed environment)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    _state = _Rendering()

    def written(self, text: Any) -> Any:
        """Every piece of text the template writes passes here (compiled in: BoundedCodeGenerator)."""
        state = self._state
        state.written += _utf8_size(text) if isinstance(text, str) else 0
        if state.written > MAX_TEXT_BYTES:
            raise TemplateBoundError(f"it wrote more than {MAX_TEXT_BYTES // 2**20} MiB of text for one row")
        if time.monotonic() > state.deadline:
            raise _Timeout()
        return text

    def bounded_join(self, parts) -> str:
        """The template's `~`: refused before joining when the result would pass the bound."""
        parts = [str(p) for p in parts]
        if sum(map(len, parts)) > MAX_TEXT_BYTES:
            raise _too_big("a string joined with ~")
        return "".join(parts)

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        _check_binop(op, left, right)
        return super().call_binop(context, op, left, right)

    def call(self, __context, __obj, *args, **kwargs):  # noqa: N807 - jinja2's signature
        if time.monotonic() > self._state.deadline:
            raise _Timeout()
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any):
        """A string's format or format_map, as the sandbox hands it out: refused when its widths pass the bound."""
        if isinstance(getattr(value, "__self__", None), str) and getattr(value, "__name__", None) in (
                "format", "format_map"):
            _check_numbers(value.__self__, "a str.format width")
        return super().wrap_str_format(value)


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _check_binop(op: str, left: Any, right: Any) -> None:
    if op == "*":
        for seq, times in ((left, right), (right, left)):
            if _sized(seq) and isinstance(times, int) and len(seq) * max(0, times) > MAX_TEXT_BYTES:
                raise _too_big("a value repeated with *")
        if isinstance(left, int) and isinstance(right, int) and \
                abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
            raise _too_big("an integer product")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > MAX_INT_BITS:
            raise _too_big("an integer power")
    elif op == "+" and _sized(left) and _sized(right) and len(left) + len(right) > MAX_TEXT_BYTES:
        raise _too_big("a value added with +")
    elif op == "%" and isinstance(left, str):
        _check_numbers(left, "a % format width")
        values = right if isinstance(right, tuple) else (right,)
        if "*" in left and any(isinstance(v, int) and abs(v) > MAX_TEXT_BYTES for v in values):
            raise _too_big("a % format width")


def _check_numbers(text: str, what: str) -> None:
    # A format string's widths and precisions are numbers in it: none may ask for more than the bound.
    if any(len(n) > 9 or int(n) > MAX_TEXT_BYTES for n in _NUMBER.findall(text)):
        raise _too_big(what)


def bounded_filter(function):
    """A filter whose numeric arguments (widths, counts) and result are held within the bound."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        for value in (*args[1:], *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_TEXT_BYTES:
                raise _too_big(f"the filter {function.__name__}'s argument")
        _check_filter_input(function.__name__, args, kwargs)
        result = function(*args, **kwargs)
        if _sized(result) and len(result) > MAX_TEXT_BYTES:
            raise _too_big(f"the result of the filter {function.__name__}")
        return result

    return wrapper


def _check_filter_input(name: str, args: tuple, kwargs: dict) -> None:
    """What a filter would build, refused before it is built: a replace's, a join's and a format's text."""
    if name == "do_replace" and len(args) >= 4 and all(isinstance(a, str) for a in args[1:4]):
        text, old, new = args[1:4]
        if len(text) + (text.count(old) if old else len(text) + 1) * len(new) > MAX_TEXT_BYTES:
            raise _too_big("a replaced string")
    elif name == "do_join" and len(args) >= 2 and isinstance(args[1], (list, tuple)):
        separator = args[2] if len(args) > 2 else kwargs.get("d", "")
        items = args[1]
        size = sum(len(i) if isinstance(i, str) else 32 for i in items)
        if size + max(0, len(items) - 1) * len(str(separator)) > MAX_TEXT_BYTES:
            raise _too_big("a joined string")
    elif name == "do_format" and args and isinstance(args[0], str):
        _check_numbers(args[0], "a format width")


def bounded_code_generator():
    """jinja2's code generator with every written piece passed through `environment.written` and `~` through
    `environment.bounded_join`."""
    from jinja2.compiler import CodeGenerator

    class BoundedCodeGenerator(CodeGenerator):
        def _output_child_pre(self, node, frame, finalize):
            self.write("environment.written(")
            super()._output_child_pre(node, frame, finalize)

        def _output_child_post(self, node, frame, finalize):
            super()._output_child_post(node, frame, finalize)
            self.write(")")

        def _output_const_repr(self, group):
            return f"environment.written({super()._output_const_repr(group)})"

        def visit_Concat(self, node, frame):
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    return BoundedCodeGenerator


def bounded_render(environment: BoundedEnvironmentMixin, stream) -> str:
    """The text of `stream` (a template's generate()), within the bounds: TemplateBoundError past one."""
    state = environment._state
    state.written, state.deadline = 0, time.monotonic() + MAX_SECONDS
    try:
        with _WATCHDOG.watching(state.deadline):
            return "".join(stream)
    except _Timeout:
        raise TemplateBoundError(f"it took more than {MAX_SECONDS:g} s to render one row") from None
    finally:
        state.written, state.deadline = 0, math.inf


class _Watchdog:
    """One daemon thread that raises _Timeout in a rendering thread whose deadline has passed, unless its block
    has ended first: a loop that writes and calls nothing is stopped too, the exception arriving between two
    bytecodes. Started on first use; a rendering costs a lock and a notification, not a thread."""

    def __init__(self):
        self.condition = threading.Condition()
        self.watched: dict[int, float] = {}  # rendering thread -> its deadline
        self.fired: set[int] = set()
        self.thread: threading.Thread | None = None
        self.wakes_at = math.inf  # when the watchdog next looks (inf: when notified)

    @contextlib.contextmanager
    def watching(self, deadline: float):
        me = threading.get_ident()
        with self.condition:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="qconvert-template-watchdog", daemon=True)
                self.thread.start()
            self.watched[me] = deadline
            if deadline < self.wakes_at:  # else it wakes in time anyway: no switch to it per rendering
                self.condition.notify()
        try:
            yield
        finally:
            with self.condition:
                self.watched.pop(me, None)
                if me in self.fired:  # raised already, or about to be: no longer wanted once the block is left
                    self.fired.discard(me)
                    _raise_in(me, None)

    def _run(self) -> None:
        with self.condition:
            while True:
                now = time.monotonic()
                for thread, deadline in list(self.watched.items()):
                    if deadline <= now:
                        del self.watched[thread]
                        self.fired.add(thread)
                        _raise_in(thread, _Timeout)
                self.wakes_at = min(self.watched.values(), default=math.inf)
                self.condition.wait(None if self.wakes_at == math.inf else max(0.0, self.wakes_at - now))


def _raise_in(thread: int, exception) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exception) if exception else None)


_WATCHDOG = _Watchdog()
