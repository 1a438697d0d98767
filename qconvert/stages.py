"""Which stage of a command is running, so an unexpected exception can be reported as one line naming it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

INTERNAL_ERROR_EXIT_CODE = 70
DEBUG_VARIABLE = "QCONVERT_DEBUG"
_ATTRIBUTE = "_qconvert_stage"


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Run a block as stage `name`: an exception leaving it is tagged with the innermost stage it crossed.

    Entering and leaving a stage is also where a received signal stops the run (see interrupts.check).
    """
    from qconvert import interrupts

    interrupts.check()
    try:
        yield
        interrupts.check()
    except BaseException as err:
        if getattr(err, _ATTRIBUTE, None) is None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(err, _ATTRIBUTE, name)
        raise


def stage_of(err: BaseException, default: str) -> str:
    """The stage an exception was raised in, or `default` when no stage block saw it."""
    return getattr(err, _ATTRIBUTE, None) or default


def internal_error_line(err: BaseException, default_stage: str) -> str:
    """`internal error in <stage>: <message> (QCONVERT_DEBUG=1 shows the traceback)`, on one line."""
    text = str(err).strip().splitlines()
    message = f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
    return (f"qconvert: internal error in {stage_of(err, default_stage)}: {message} "
            f"({DEBUG_VARIABLE}=1 shows the traceback)")
