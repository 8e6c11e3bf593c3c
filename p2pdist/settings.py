"""Checks for the numbers users put in settings and calls: seconds and integer sizes.

One rule everywhere: a bool is not a number, numpy's numbers are, and a bad value is a
:class:`~p2pdist.errors.UsageError` (a ValueError) naming the setting and the value.
"""

from __future__ import annotations

import math
import numbers
import operator
import os

import numpy as np

from .errors import UsageError

__all__ = ["INT_MAX", "as_int", "check_int", "check_seconds", "env_flag", "env_token"]


def check_seconds(name: str, value: object) -> float:
    """``value`` as float seconds when it is a positive finite number (not NaN or inf: a
    NaN deadline is never enforced)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
        seconds = float(value)
        if math.isfinite(seconds) and seconds > 0:
            return seconds
    raise UsageError(f"{name} must be a positive finite number of seconds, got {value!r}")


def as_int(x: object) -> int | None:
    """``x`` as a plain int when it is an integer (numpy's too: ranks often come from
    numpy), None otherwise; a bool is not taken for a number."""
    if isinstance(x, bool | np.bool_):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


INT_MAX = 2**63 - 1
"""The largest integer :func:`check_int` takes: what travels as a signed 64-bit integer
(msgpack cannot encode a larger one, and a count or round past it is no real one)."""


def check_int(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int when it is an integer of at least ``minimum`` and at most
    :data:`INT_MAX` (a bad argument is refused before anything is recorded or sent)."""
    size = as_int(value)
    if size is None or size < minimum:
        raise UsageError(f"{name} must be an integer of at least {minimum}, got {value!r}")
    if size > INT_MAX:
        raise UsageError(f"{name} must be at most 2**63 - 1, got {value!r}")
    return size


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def decimal_int(text: str) -> int:
    """``text`` (an environment variable's value) as a plain decimal integer, spaces
    around it allowed; ValueError for anything else (``int()`` takes ``"0_1"`` and other
    scripts' digits, which no launcher writes)."""
    stripped = text.strip()
    if not (stripped.isascii() and stripped.isdigit()):
        raise ValueError(f"not a decimal integer: {text!r}")
    return int(stripped)


def env_flag(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a yes/no (1/0, true/false, yes/no, on/off,
    any case; unset or empty: ``default``); UsageError naming it for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise UsageError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def env_token(name: str = "P2PDIST_RELAY_TOKEN") -> str | None:
    """A relay token from the environment: None when unset; UsageError when set but
    empty (as the relay refuses to start with it: unset it for no token)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if not value:
        raise UsageError(f"{name} is set but empty: unset it for no token")
    return value
