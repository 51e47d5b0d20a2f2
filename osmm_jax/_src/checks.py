"""Argument checks shared by the pure-Python modules, with messages that name the problem."""

from __future__ import annotations

import math


def integer(value, name: str, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum``; TypeError for non-integers (and bools)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        hint = " (non-negative)" if minimum == 0 else ""
        raise ValueError(f"{name} must be at least {minimum}{hint}, got {value}")
    return value


def speeds(values, what: str = "GFLOP/s", name: str = "speeds") -> tuple[float, ...]:
    """One finite, non-negative speed (or weight) per rank, not all zero."""
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of numbers, got {values!r}") from None
    if not items:
        raise ValueError(f"{name} is empty: give one ({what}) per rank")
    out = []
    for i, s in enumerate(items):
        try:
            s = float(s)
        except (TypeError, ValueError):
            raise TypeError(f"{name}[{i}] must be a number, got {s!r}") from None
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"{name}[{i}] is {s}: {name} must be finite and non-negative")
        out.append(s)
    if not any(out):
        raise ValueError(f"{name} {list(items)} are all zero: at least one rank must get work")
    return tuple(out)
