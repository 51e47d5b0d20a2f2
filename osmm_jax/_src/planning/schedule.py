"""The records of a plan's cells: who multiplies, gets, delivers and adds what, in which order.

:func:`build_schedule` turns the decisions of :func:`~osmm_jax._src.planning.cells.decide`
into records (:mod:`osmm_jax._src.planning.records`), for every cell of a plan or for the
cells one rank takes part in, which give exactly that rank's records of the whole plan: each
input piece got once per rank from its owner (adjacent pieces from one owner joined into one
get, :func:`_joined_gets`), the partials of one C rectangle summed before they are sent, a
``put`` where one partial is all a rectangle receives (:func:`_sole_origin`), else an
``accumulate``. :func:`gather_gets` makes the gets of a gather stage's all-gather.

Pure Python; imports neither JAX nor MPI.
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace
from typing import NamedTuple

from osmm_jax._src.planning.cells import EVERYONE, Cells, decide, delivered_to
from osmm_jax._src.planning.layout import Interval, Layout
from osmm_jax._src.planning.records import LocalMultiply, LocalUpdate, Transfer

_Products = dict[tuple[int, int, int, int], tuple[bool, int, int]]
"""``(rank, mi, ki, ni) -> (primary, a_source, b_source)``: the cells each rank multiplies."""

_Gets = dict[tuple[int, str, Interval, Interval], Transfer]
"""``(origin, matrix, rows, cols) -> get``: each input piece a rank gets, once."""

_Deliveries = defaultdict[tuple[int, int, int, int], list[int]]
"""``(origin, target, mi, ni) -> [ki, ...]``: the K cells whose products ``origin`` sums into
the C rectangle ``(mi, ni)`` of ``target`` (itself for a local update)."""


class Schedule(NamedTuple):
    """The records of a plan, or of one rank's part of it (see :func:`build_schedule`)."""

    multiplies: tuple[LocalMultiply, ...]
    gets: tuple[Transfer, ...]
    deliveries: tuple[Transfer, ...]
    local_updates: tuple[LocalUpdate, ...]


def build_schedule(
    cells: Cells, keys: Iterable[tuple[int, int, int]], rank: int | None, compute_at_inputs: bool
) -> Schedule:
    """The multiplies, gets, deliveries and local updates of the cells ``keys``: all of them
    (``rank`` None), or only those ``rank`` performs, serves or receives.

    Each cell is decided by :func:`decide` alone, so the records of one rank are exactly those
    the whole plan has for it. A server sums its partials of one C rectangle for one target
    over the K cells before sending. A delivery is a ``put`` when it is the only one its
    rectangle receives (:func:`_sole_origin`; the target's own partial is added at the end,
    outside the window), else an ``accumulate``.

    Ordering: multiplies by ``(rank, mi, ki, ni)``; gets and deliveries each by origin and,
    within an origin, by target starting at the next rank (so ranks do not all target the same
    owner at once), then by rectangle; local updates by ``(rank, rows, cols)``. Each input
    piece is got once per rank, from its owner.
    """
    products, gets, deliveries = _decided_records(cells, keys, rank, compute_at_inputs)
    multiplies = tuple(
        LocalMultiply(r, cells.m[mi], cells.k[ki], cells.n[ni], a_src, b_src, primary)
        for (r, mi, ki, ni), (primary, a_src, b_src) in sorted(products.items())
    )
    nranks = cells.nranks
    get_list = tuple(
        sorted(
            _joined_gets(gets.values()),
            key=lambda t: (_rotated(t.origin, t.target, nranks), t.rows, t.cols, t.matrix),
        )
    )
    c_transfers, local_updates = _c_records(cells, deliveries, compute_at_inputs)
    return Schedule(multiplies, get_list, c_transfers, local_updates)


def _rotated(origin: int, target: int, nranks: int) -> int:
    """The sort key of ``(origin, target)``: by origin, then by target from the next rank on."""
    return origin * nranks + (target - origin) % nranks


def _decided_records(
    cells: Cells, keys: Iterable[tuple[int, int, int]], rank: int | None, compute_at_inputs: bool
) -> tuple[_Products, _Gets, _Deliveries]:
    """Decide every cell of ``keys`` and note what it makes: the products, the gets and the
    partials each server delivers (all of them, or only those ``rank`` takes part in), for
    :func:`build_schedule` to put in order."""
    everyone = range(cells.nranks)
    products: _Products = {}
    gets: _Gets = {}
    deliveries: _Deliveries = defaultdict(list)
    for mi, ki, ni in keys:
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        a, b, c = d.a_owner, d.b_owner, d.c_owner
        self_serving = everyone if d.self_serving == (EVERYONE,) else d.self_serving
        for r in self_serving if rank is None else ((rank,) if rank in self_serving else ()):
            products[(r, mi, ki, ni)] = (r == d.primary, r, r)
            deliveries[(r, r, mi, ni)].append(ki)
        s = d.server
        if s < 0:
            continue
        involved = rank is None or rank == s
        a_src = s if a in (EVERYONE, s) else a
        b_src = s if b in (EVERYONE, s) else b
        if involved:
            products[(s, mi, ki, ni)] = (True, a_src, b_src)
        for matrix, src, rows, cols in (
            ("A", a_src, cells.m[mi], cells.k[ki]),
            ("B", b_src, cells.k[ki], cells.n[ni]),
        ):
            if src != s and (involved or rank == src):
                key = (s, matrix, rows, cols)
                if key not in gets:
                    gets[key] = Transfer("get", matrix, s, src, rows, cols)
        if c != EVERYONE:
            targets: Iterable[int] = (c,)
        else:
            targets = (t for t in (everyone if involved else (rank,)) if delivered_to(d, t))
        for t in targets:
            if involved or rank == t:
                if t == s and s in d.self_serving:
                    continue  # already added: the server computes the cell for itself too
                deliveries[(s, t, mi, ni)].append(ki)
    return products, gets, deliveries


def _c_records(
    cells: Cells, deliveries: _Deliveries, compute_at_inputs: bool
) -> tuple[tuple[Transfer, ...], tuple[LocalUpdate, ...]]:
    """The C deliveries (puts and accumulates) and local updates of ``deliveries``, in the
    order of :func:`build_schedule`."""
    nranks = cells.nranks
    sole: dict[tuple[int, int, int], bool] = {}  # (target, mi, ni) -> one origin delivers
    lone_k = [(iv,) for iv in cells.k]  # one shared tuple per K cell for one-term sums
    c_transfers, local_updates = [], []
    for origin, target, mi, ni in sorted(
        deliveries, key=lambda key: (_rotated(key[0], key[1], nranks), key[2], key[3])
    ):
        kis = deliveries[(origin, target, mi, ni)]
        inner = lone_k[kis[0]] if len(kis) == 1 else tuple(cells.k[ki] for ki in sorted(kis))
        if origin == target:
            local_updates.append(LocalUpdate(origin, cells.m[mi], cells.n[ni], inner))
        else:
            if (target, mi, ni) not in sole:
                sole[(target, mi, ni)] = _sole_origin(cells, target, mi, ni, compute_at_inputs)
            op = "put" if sole[(target, mi, ni)] else "accumulate"
            c_transfers.append(Transfer(op, "C", origin, target, cells.m[mi], cells.n[ni], inner))
    return tuple(c_transfers), tuple(local_updates)


def _joined_gets(gets: Iterable[Transfer]) -> list[Transfer]:
    """``gets`` with the pieces one rank gets from one owner joined where they tile a larger
    rectangle: first side by side (same rows, adjacent columns), then one above the other.

    A rank's box of a :class:`Work` split needs, from the owner of a slice of A, pieces that
    B's slices cut along K (4 x 4 x 4 ranks: 12 gets of A where 3 do). One MPI_Get of a strided
    rectangle costs one message instead of several. The result depends only on the pieces of
    each (origin, owner, matrix), which a rank's own part of a plan holds whole, on both sides.
    """
    groups: defaultdict[tuple[int, int, str], list[Transfer]] = defaultdict(list)
    for t in gets:
        groups[(t.origin, t.target, t.matrix)].append(t)
    joined: list[Transfer] = []
    for group in groups.values():
        if len(group) > 1:
            group = _join_adjacent(group, along_cols=True)
            group = _join_adjacent(group, along_cols=False)
        joined += group
    return joined


def _join_adjacent(gets: list[Transfer], along_cols: bool) -> list[Transfer]:
    """Runs of gets with the same rows (``along_cols``) or columns whose other extents meet
    end to start, each joined into one get."""

    def extents(t: Transfer) -> tuple[Interval, Interval]:
        return (t.rows, t.cols) if along_cols else (t.cols, t.rows)

    out: list[Transfer] = []
    for t in sorted(gets, key=extents):
        if out:
            same, last = extents(out[-1])
            fixed, span = extents(t)
            if fixed == same and span[0] == last[1]:
                joined = (last[0], span[1])
                out[-1] = replace(out[-1], **({"cols": joined} if along_cols else {"rows": joined}))
                continue
        out.append(t)
    return out


def _sole_origin(cells: Cells, target: int, mi: int, ni: int, compute_at_inputs: bool) -> bool:
    """Whether exactly one rank other than ``target`` delivers a partial of the C rectangle
    ``(mi, ni)`` into ``target``'s window (found from the rectangle's cells alone, so a rank's
    own part of a plan says the same as the whole plan).

    Such a delivery is a ``put``: the window is all zeros when the epoch opens and nothing else
    lands on that rectangle, so writing the partial is adding it to zero. Over a network a put
    is a plain remote write, while MPICH completes an accumulate with an active message that
    the target must process (2048^3 K-split on 2 ranks over TCP: closing fence 11 -> 3 ms).
    """
    origin = -1
    for ki in range(len(cells.k)):
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        s = d.server
        if s < 0 or s == target or not delivered_to(d, target):
            continue
        if origin >= 0 and s != origin:
            return False
        origin = s
    return origin >= 0


def gather_gets(split: Layout, origins: Iterable[int] | None = None, owner: int | None = None):
    """The gets of a gather stage's all-gather: every rank of ``origins`` (default: all) gets
    every other rank's block of ``split``, or only ``owner``'s block; rotated by origin, as
    deliveries."""
    n = split.nranks
    found = []
    for origin in range(n) if origins is None else origins:
        steps = range(1, n) if owner is None else ((owner - origin) % n,)
        for step in steps:
            if step == 0:
                continue
            block_owner = (origin + step) % n
            rows, cols = split.blocks[block_owner]
            if rows[1] > rows[0] and cols[1] > cols[0]:
                found.append(Transfer("get", "C", origin, block_owner, rows, cols))
    return tuple(found)


@contextlib.contextmanager
def collector_paused():
    """Pause Python's cyclic garbage collector while a schedule is built.

    A plan of P ranks allocates up to millions of tuples and records, none of them in a
    reference cycle; each allocation burst triggers a collection that walks every object still
    alive, which more than doubles the time of large plans. Restored on exit (even on error)
    unless it was already off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
