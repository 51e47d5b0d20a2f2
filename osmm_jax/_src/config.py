"""Every environment variable osmm_jax reads, with its default, in one place."""

from __future__ import annotations

import os

USE_ALLREDUCE = "OSMM_USE_ALLREDUCE"
"""``1``/``true``/``yes``/``on``: the default ``method`` of :func:`osmm_jax.matmul` is ``"allreduce"``
instead of ``"one_sided"``. Default: unset (one_sided)."""

VERIFY = "OSMM_VERIFY"
"""``1``/``true``/``yes``/``on``: :func:`osmm_jax.matmul` verifies every product by checksum
(as with ``verify=True``). Default: unset (no verification)."""

METHODS = ("one_sided", "allreduce")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def default_method() -> str:
    """The method used when a caller passes ``method=None``."""
    return "allreduce" if _flag(USE_ALLREDUCE) else "one_sided"


def resolve_method(method: str | None) -> str:
    if method is None:
        return default_method()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    return method


def resolve_verify(verify: bool | None) -> bool:
    """Whether to verify a product: the argument if given, else ``OSMM_VERIFY``."""
    if verify is None:
        return _flag(VERIFY)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True, False or None, got {verify!r}")
    return verify


SPEEDS = "OSMM_SPEEDS"
"""Comma-separated GEMM rates in GFLOP/s, one per rank in rank order (e.g. ``300,300,125,125``):
:func:`osmm_jax.profile_speeds` returns these instead of measuring. Default: unset (measure)."""


def declared_speeds_text() -> str | None:
    """The raw value of ``OSMM_SPEEDS``, or None when it is unset or blank (parsed by ``speeds.py``)."""
    return os.environ.get(SPEEDS, "").strip() or None
