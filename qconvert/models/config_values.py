"""Reading config.json values with their types checked: a wrong type is one line naming the key (exit 6)."""

from __future__ import annotations

from typing import Any

from qconvert.formats.errors import InvalidCheckpointError

_MISSING = object()


def _bad(key: str, value: Any, want: str) -> InvalidCheckpointError:
    return InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be {want}")


# The largest whole number a config value may hold: a count past it (1e308 layers) describes no checkpoint, and
# would only reach the code that sizes per-layer tables.
CONFIG_INT_MAX = 2**31 - 1


def config_int(config: dict[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """config[key] as an int in [minimum, CONFIG_INT_MAX] (JSON integers, or floats with a whole value: "two",
    2.5, 1e308 and true are refused).

    `default` (which may be None) when the key is absent or null; without one, a missing key is an error.
    """
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            raise InvalidCheckpointError(f"config.json has no {key}; the model's config must give it")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise _bad(key, value, "a whole number")
    if int(value) > CONFIG_INT_MAX:
        raise _bad(key, value, f"at most {CONFIG_INT_MAX}")
    if int(value) < minimum:
        raise _bad(key, value, f"at least {minimum}")
    return int(value)


def config_float(config: dict[str, Any], key: str, default: float) -> float:
    """config[key] as a positive float (a missing or null key gives `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _bad(key, value, "a positive number")
    return float(value)


def config_fraction(config: dict[str, Any], key: str, default: float) -> float:
    """config[key] as a number in (0, 1] (a missing or null key gives `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise _bad(key, value, "a number in (0, 1]")
    return float(value)


def config_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    """config[key] as a bool (a missing or null key gives `default`)."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def config_layer_list(config: dict[str, Any], key: str, layers: int) -> tuple[int, ...]:
    """config[key] as a list of layer indices in [0, layers) (() when absent or null)."""
    value = config.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value):
        raise _bad(key, value, f"a list of layer indices in [0, {layers})")
    return tuple(value)


def require_divides(config: dict[str, Any], divisor_key: str, divisor: int, key: str, value: int) -> None:
    """`divisor` (config's `divisor_key`) must divide `value` (config's `key`)."""
    if value % divisor:
        raise InvalidCheckpointError(
            f"config.json: {divisor_key} = {divisor} does not divide {key} = {value}; the config is inconsistent")
