"""Reading config.json values with their types checked: a wrong type is one line naming the key (exit 6)."""

from __future__ import annotations

from typing import Any

from qconvert.errors import InvalidCheckpointError

_MISSING = object()


def config_int(config: dict[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """config[key] as an int >= minimum (JSON integers only: "two", 2.5 and true are refused)."""
    value = config.get(key, default) if default is not _MISSING else config.get(key, _MISSING)
    if value is _MISSING:
        raise InvalidCheckpointError(f"config.json has no {key}; the model's config must give it")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be a whole number")
    if int(value) < minimum:
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be at least {minimum}")
    return int(value)


def config_float(config: dict[str, Any], key: str, default: float) -> float:
    """config[key] as a positive float (a missing or null key gives `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be a positive number")
    return float(value)


def config_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    """config[key] as a bool (a missing or null key gives `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be true or false")
    return value


def require_divides(config: dict[str, Any], divisor_key: str, divisor: int, key: str, value: int) -> None:
    """`divisor` (config's `divisor_key`) must divide `value` (config's `key`)."""
    if value % divisor:
        raise InvalidCheckpointError(
            f"config.json: {divisor_key} = {divisor} does not divide {key} = {value}; the config is inconsistent")
