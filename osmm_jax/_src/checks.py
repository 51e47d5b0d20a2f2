"""Argument checks shared by the pure-Python modules, with messages that name the problem.

Every helper returns the checked value converted (``int`` or ``float``, tuples of
floats for sequences) and raises TypeError for a value of the wrong kind
(``bool`` is never taken for a number) and ValueError for one out of range. The
messages name the argument, the value and what was expected.

Pure Python: no JAX, no MPI.
"""

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


def integers(values, name: str, count: int, form: str, minimum: int = 0) -> tuple[int, ...]:
    """``values`` as ``count`` ints of at least ``minimum`` (``name[i]`` in errors): TypeError
    when not a sequence, or an entry not an integer; ValueError when it has another length
    (the message says ``name`` must be ``form``, e.g. ``"2-D (rows, cols)"``) or an entry is
    too small."""
    try:
        items = tuple(values)
    except TypeError:
        raise TypeError(f"{name} must be {form}, got {values!r}") from None
    if len(items) != count:
        raise ValueError(f"{name} must be {form}, got {values!r}")
    return tuple(integer(v, f"{name}[{i}]", minimum) for i, v in enumerate(items))


def real(value, name: str) -> float:
    """``value`` as a float, nan and inf included; TypeError for non-numbers (and bools)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def at_least(value, name: str, minimum: float, *, allow_inf: bool = False) -> float:
    """``value`` as a float of at least ``minimum``: never nan; inf only with ``allow_inf``."""
    out = real(value, name)
    if math.isnan(out) or out < minimum or (math.isinf(out) and not allow_inf):
        finite = "" if allow_inf else "finite and "
        raise ValueError(f"{name} must be {finite}at least {minimum}, got {value!r}")
    return out


def positive_real(value, name: str) -> float:
    """``value`` as a finite float greater than zero."""
    out = real(value, name)
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return out


def _reals(values, name: str) -> tuple[float, ...]:
    """``values`` (a sequence, not a string) as floats, each as :func:`real` takes it."""
    try:
        if isinstance(values, (str, bytes)):
            raise TypeError
        items = list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of numbers, got {values!r}") from None
    return tuple(real(v, f"{name}[{i}]") for i, v in enumerate(items))


def non_negative_reals(values, name: str) -> tuple[float, ...]:
    """``values`` as floats, each finite and non-negative (the sequence may be empty)."""
    out = _reals(values, name)
    for i, v in enumerate(out):
        if not math.isfinite(v):
            raise ValueError(f"{name}[{i}] is {v}: {name} must be finite")
        if v < 0:
            raise ValueError(f"{name}[{i}] is {v}: {name} must be non-negative")
    return out


def speeds(values, what: str = "GFLOP/s", name: str = "speeds") -> tuple[float, ...]:
    """One finite, non-negative speed (or weight, in ``what``) per rank, not all zero."""
    out = non_negative_reals(values, name)
    if not out:
        raise ValueError(f"{name} is empty: give one ({what}) per rank")
    if not any(out):
        raise ValueError(f"{name} {list(out)} are all zero: at least one rank must get work")
    return out


def positive_speeds(values, nranks: int, name: str = "speeds") -> tuple[float, ...]:
    """Exactly ``nranks`` speeds, each finite and greater than zero (declared GEMM rates)."""
    out = _reals(values, name)
    if len(out) != nranks:
        raise ValueError(f"{name} has {len(out)} values but there are {nranks} ranks")
    for r, s in enumerate(out):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"{name}: rank {r}'s speed is {s}; speeds must be finite and > 0")
    return out
