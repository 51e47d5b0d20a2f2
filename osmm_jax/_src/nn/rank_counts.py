"""Checking the per-rank counts the Flax layers take: ``row_sizes``, ``sizes``, ``batch_sizes``.

Each is one non-negative integer per rank of the layer's communicator, in rank order (rows,
kernel columns or rows, batch entries); uneven, possibly 0. The checks are pure (no JAX, no
MPI: testable without ``mpiexec``); the layers run them on every rank together, so that a
mistake on one rank raises the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from osmm_jax._src import checks


def counts_per_rank(
    values,
    nranks: int,
    name: str,
    *,
    entries: str,
    give: str,
    required: str | None = None,
    any_iterable: bool = True,
) -> tuple[int, ...]:
    """``values`` as a tuple of ``nranks`` non-negative ints, one per rank.

    Args:
        values: the argument as given: a sequence, an array or, with ``any_iterable``,
            any iterable (a generator, a range, ...).
        nranks: the number of ranks of the communicator.
        name: the argument's name, for messages (``"row_sizes"``).
        entries: what the entries are, for messages (``"row counts"``).
        give: what a value of the wrong length should give instead, for messages
            (``"one row count per rank"``).
        required: what a missing value (None) should have given, for messages; None: a
            missing value is reported as not a sequence.
        any_iterable: take any iterable; False: only a sized one other than a string.

    Raises:
        TypeError: ``values`` is missing, not a sequence, or holds a non-integer (a float or
            a bool included).
        ValueError: the wrong number of entries, or a negative entry.
    """
    if values is None and required is not None:
        raise TypeError(f"{name} is required: {required}")
    counts = values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        counts = _as_tuple(values, any_iterable)
        if counts is None:
            raise TypeError(f"{name} must be a sequence of {entries}, one per rank, got {values!r}")
    if len(counts) != nranks:
        raise ValueError(
            f"{name} {list(counts)} has {len(counts)} entries but the communicator has "
            f"{nranks} ranks: give {give}"
        )
    return tuple(checks.integer(c, f"{name}[{i}]") for i, c in enumerate(counts))


def _as_tuple(values, any_iterable: bool) -> tuple | None:
    """``values`` as a tuple, or None when it is not one to take (see :func:`counts_per_rank`)."""
    if not any_iterable and (isinstance(values, (str, bytes)) or not hasattr(values, "__len__")):
        return None
    try:
        return tuple(values)
    except TypeError:
        return None
