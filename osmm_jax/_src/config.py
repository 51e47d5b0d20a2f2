"""Every environment variable osmm_jax reads, with its default, in one place."""

from __future__ import annotations

import os

USE_ALLREDUCE = "OSMM_USE_ALLREDUCE"
"""``1``/``true``/``yes``/``on``: the default ``method`` of :func:`osmm_jax.matmul` is ``"allreduce"``
instead of ``"one_sided"``. Default: unset (one_sided)."""

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
