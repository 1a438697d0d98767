"""Typed reads of config.json values: a wrong type or value is one InvalidCheckpointError naming the key."""

from __future__ import annotations

from typing import Any

from qconvert.errors import InvalidCheckpointError

_MISSING = object()


def _bad(key: str, value: Any, want: str) -> InvalidCheckpointError:
    return InvalidCheckpointError(f"config.json: {key} is {value!r}, it must be {want}; "
                                  "restore the file from the model's source")


def config_int(config: dict[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """An integer >= minimum (bools are not integers); `default` when the key is absent or null."""
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            raise InvalidCheckpointError(f"config.json has no {key}; restore the file from the model's source")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, value, f"an integer >= {minimum}")
    return value


def config_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    """true or false; `default` when the key is absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def config_fraction(config: dict[str, Any], key: str, default: float) -> float:
    """A number in (0, 1]; `default` when the key is absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _bad(key, value, "a number in (0, 1]")
    return float(value)


def config_layer_list(config: dict[str, Any], key: str, layers: int) -> tuple[int, ...]:
    """A list of layer indices in [0, layers); () when the key is absent or null."""
    value = config.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value):
        raise _bad(key, value, f"a list of layer indices in [0, {layers})")
    return tuple(value)
