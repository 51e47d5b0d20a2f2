"""Per-rank figures of a plan: flops, elements and bytes sent and received, modelled time.

:func:`per_rank_totals` sums any quantity of a plan's records into one bucket per rank (or per
pair of ranks). :class:`Totals` holds the figures a cost model needs without the records, and
:func:`schedule_totals` computes them from the decisions of the cells alone, as
:func:`~osmm_jax._src.planning.schedule.build_schedule` would make the records;
:func:`with_gathers` adds what a gather stage's all-gather moves. :func:`rank_speeds` reads
the speeds a plan's layouts were made for, and :func:`modelled_balance` turns flops and link
bytes into each rank's modelled time (:class:`Balance`, what :meth:`Plan.balance` reports).

Pure Python; imports neither JAX nor MPI.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from osmm_jax._src.planning.cells import EVERYONE, Cells, decide
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.records import PlanFacts, Transfer, interval_size

NOMINAL_SPEED = 100e9
"""Flops/s :meth:`Plan.balance` gives a rank of relative speed 1 (XLA's CPU dot measured 90-160
GFLOP/s here), for reporting how even a plan is."""

NOMINAL_BANDWIDTH = 5e9
"""Bytes/s :meth:`Plan.balance` gives every rank's link, each way (one-sided accumulates measured
4-10 GiB/s between ranks of one machine; the same default as :func:`osmm_jax.auto_layouts`)."""


def per_rank_totals(
    items: Iterable, nranks: int, by: str | tuple[str, ...], amount: str | Callable[[Any], int]
) -> tuple:
    """Sum a per-item quantity into one bucket per rank.

    ``by`` names the item attribute that holds the bucket's rank: ``"rank"`` of a
    :class:`LocalMultiply`; ``"sender"``, ``"receiver"``, ``"origin"`` (the issuer) or
    ``"target"`` of a :class:`Transfer`. ``amount`` is an attribute name (``"flops"``,
    ``"elements"``) or a function of the item. Returns ``nranks`` totals; with two names, e.g.
    ``("sender", "receiver")``, an ``nranks x nranks`` table as a tuple of rows.
    """
    names = (by,) if isinstance(by, str) else tuple(by)
    value = operator.attrgetter(amount) if isinstance(amount, str) else amount
    totals = [0] * nranks ** len(names)
    for item in items:
        index = 0
        for name in names:
            index = index * nranks + getattr(item, name)
        totals[index] += value(item)
    for _ in names[1:]:
        totals = [tuple(totals[i : i + nranks]) for i in range(0, len(totals), nranks)]
    return tuple(totals)


def transfer_bytes(input_itemsize: int, accum_itemsize: int) -> Callable[[Transfer], int]:
    """The bytes a transfer moves at these item sizes, as an ``amount`` of
    :func:`per_rank_totals`."""
    return lambda t: t.nbytes(input_itemsize, accum_itemsize)


def larger(xs: Sequence[int], ys: Sequence[int]) -> tuple[int, ...]:
    """The larger of ``xs[r]`` and ``ys[r]`` for every rank ``r``: what the busier direction of
    each rank's link carries when ``xs`` are sent and ``ys`` received."""
    return tuple(max(x, y) for x, y in zip(xs, ys))


def block_area(layout: Layout, rank: int) -> int:
    """Elements of ``rank``'s block of ``layout``."""
    rows, cols = layout.local_shape(rank)
    return rows * cols


def transfers_facts(transfers: Sequence[Transfer], a: Layout, b: Layout) -> PlanFacts:
    """The :class:`PlanFacts` of a whole plan, read from its transfers (of the product of
    ``a`` and ``b``)."""
    nranks = a.nranks
    largest = []
    for matrix, layout in (("A", a), ("B", b)):
        gets = (t for t in transfers if t.op == "get" and t.matrix == matrix)
        served = per_rank_totals(gets, nranks, "target", lambda t: 1)
        exposed = [block_area(layout, r) for r in range(nranks) if served[r]]
        largest.append(max(exposed, default=0))
    origins: dict[int, set[int]] = {}
    owners: dict[int, set[int]] = {}
    fetched = [0] * nranks
    pairs: dict[tuple[int, int], int] = {}  # (getter, owner) -> elements
    for t in transfers:
        if t.op != "get":
            origins.setdefault(t.target, set()).add(t.origin)
        elif t.matrix != "C":
            owners.setdefault(t.origin, set()).add(t.target)
            fetched[t.origin] += t.elements
            pairs[(t.origin, t.target)] = pairs.get((t.origin, t.target), 0) + t.elements
    return PlanFacts(
        any(t.op == "get" and t.matrix != "C" for t in transfers),
        any(t.op != "get" for t in transfers),
        (largest[0], largest[1]),
        max((len(o) for o in origins.values()), default=0),
        max(fetched, default=0),
        max((len(o) for o in owners.values()), default=0),
        max(pairs.values(), default=0),
    )


class Totals(NamedTuple):
    """Per-rank figures of a plan, without its records: ``flops``; ``inputs``, the A/B elements
    other ranks get from each rank; ``partials``, the C elements each rank delivers;
    ``received_inputs``, the A/B elements each rank gets from other ranks; ``received_partials``,
    the C elements other ranks deliver into each rank's block. Every transfer is counted once
    at its sender and once at its receiver, so both pairs have the same sum over ranks."""

    flops: tuple[int, ...]
    inputs: tuple[int, ...]
    partials: tuple[int, ...]
    received_inputs: tuple[int, ...] = ()
    received_partials: tuple[int, ...] = ()

    def sent(self) -> tuple[int, ...]:
        """Elements leaving each rank: the pieces others get from it and its partials."""
        return tuple(i + p for i, p in zip(self.inputs, self.partials))

    def received(self) -> tuple[int, ...]:
        """Elements arriving at each rank: the pieces it gets and the partials delivered to it."""
        return tuple(i + p for i, p in zip(self.received_inputs, self.received_partials))

    def link(self) -> tuple[int, ...]:
        """Elements on the busier direction of each rank's link: the larger of sent and
        received."""
        return larger(self.sent(), self.received())


def schedule_totals(cells: Cells, compute_at_inputs: bool = False) -> Totals:
    """The :class:`Totals` of every rank of a whole (unstaged) plan, as
    :func:`~osmm_jax._src.planning.schedule.build_schedule` would make them: a piece is got
    once per rank, a partial sent once per target and C rectangle."""
    nranks = cells.nranks
    flops, inputs, partials = [0] * nranks, [0] * nranks, [0] * nranks
    received_inputs, received_partials = [0] * nranks, [0] * nranks
    # Partials of a replicated C reach every rank but their server: summed once, the server's
    # own taken off at the end.
    to_everyone, own_to_everyone = 0, [0] * nranks
    fetched, delivered = set(), set()
    for mi, ki, ni in cells.every_cell():
        d = decide(cells, mi, ki, ni, compute_at_inputs)
        f = cells.flops(mi, ki, ni)
        if d.self_serving == (EVERYONE,):
            for r in range(nranks):
                flops[r] += f
            continue
        for r in d.self_serving:
            flops[r] += f
        s = d.server
        if s < 0:
            continue
        if s not in d.self_serving:
            flops[s] += f
        m, k, n = interval_size(cells.m[mi]), interval_size(cells.k[ki]), interval_size(cells.n[ni])
        if d.a_owner not in (EVERYONE, s) and (s, 0, mi, ki) not in fetched:
            fetched.add((s, 0, mi, ki))
            inputs[d.a_owner] += m * k
            received_inputs[s] += m * k
        if d.b_owner not in (EVERYONE, s) and (s, 1, ki, ni) not in fetched:
            fetched.add((s, 1, ki, ni))
            inputs[d.b_owner] += k * n
            received_inputs[s] += k * n
        if (s, mi, ni) not in delivered:
            delivered.add((s, mi, ni))
            if d.c_owner == EVERYONE:
                partials[s] += m * n * (nranks - 1)
                to_everyone += m * n
                own_to_everyone[s] += m * n
            elif d.c_owner != s:
                partials[s] += m * n
                received_partials[d.c_owner] += m * n
    if to_everyone:
        received_partials = [
            r + to_everyone - own for r, own in zip(received_partials, own_to_everyone)
        ]
    columns = (flops, inputs, partials, received_inputs, received_partials)
    return Totals(*(tuple(column) for column in columns))


def with_gathers(totals: Totals, split: Layout) -> Totals:
    """The ``totals`` of a gather stage's plan into the even ``split`` of C, with its gathers
    added: the gathered C blocks travel like the A/B pieces (in the input dtype), each owner's
    block to every other rank."""
    gathered, got = _gathered_sent(split), _gathered_received(split)
    return totals._replace(
        inputs=tuple(i + g for i, g in zip(totals.inputs, gathered)),
        received_inputs=tuple(i + g for i, g in zip(totals.received_inputs, got)),
    )


def _gathered_sent(split: Layout) -> list[int]:
    """Elements each rank sends in the gathers of ``split``
    (:func:`~osmm_jax._src.planning.schedule.gather_gets`, counted at the owner): its block, once
    to every other rank."""
    others = split.nranks - 1
    return [block_area(split, r) * others for r in range(split.nranks)]


def _gathered_received(split: Layout) -> list[int]:
    """Elements each rank gets in the gathers of ``split`` (counted at the rank that gets):
    every other rank's block."""
    areas = [block_area(split, r) for r in range(split.nranks)]
    total = sum(areas)
    return [total - own for own in areas]


def rank_speeds(a: Layout, b: Layout, c: Layout) -> tuple[float, ...]:
    """The relative speed (mean 1) each rank was given work for, read from the layouts: its
    share of C's area.

    A plan is a function of its layouts alone (equal layouts, equal plan, on every rank and in
    every cache), so it is not told the ranks' measured speeds. Layouts made from speeds
    (:func:`osmm_jax.balance`, :func:`osmm_jax.auto_layouts`) already carry them: each rank's
    block of the output is in proportion to its speed, and stationary-C work (each rank
    computes its own block of C) is then balanced. So a rank's speed is taken as its C area
    over the mean; when C is replicated, from A's areas, then B's; equal when every operand is
    replicated or uniform. A rank with an empty block is taken as a hundredth of the mean.
    :meth:`Plan.balance` reports each rank's modelled time at these speeds.
    """
    nranks = a.nranks
    for layout in (c, a, b):
        if layout.is_replicated:
            continue
        areas = [block_area(layout, r) for r in range(nranks)]
        total = sum(areas)
        if total:
            return tuple(max(x * nranks / total, 0.01) for x in areas)
    return (1.0,) * nranks


class Balance(NamedTuple):
    """The modelled time of each rank of a plan (see :meth:`Plan.balance`).

    ``compute[r]`` is rank ``r``'s flops at its speed, ``communicate[r]`` the busier direction
    of its link (the larger of the bytes it sends and receives) at the link's bandwidth,
    ``seconds[r]`` their sum; ``busiest`` the rank with the largest sum and
    ``ratio`` that sum over the mean (1.0 when nothing is done).
    """

    compute: tuple[float, ...]
    communicate: tuple[float, ...]
    seconds: tuple[float, ...]
    busiest: int
    ratio: float


def modelled_balance(
    flops: Sequence[int], link_bytes: Sequence[int], speeds: Sequence[float], bandwidth: float
) -> Balance:
    """Each rank's modelled time: its ``flops`` at its speed (flops/s) plus its ``link_bytes``
    (the busier direction of its link) at ``bandwidth`` bytes/s."""
    nranks = len(flops)
    if len(speeds) != nranks:
        raise ValueError(f"{len(speeds)} speeds for a plan over {nranks} ranks")
    compute = tuple((f / s if s > 0 else float("inf")) if f else 0.0 for f, s in zip(flops, speeds))
    communicate = tuple(b / bandwidth for b in link_bytes)
    seconds = tuple(x + y for x, y in zip(compute, communicate))
    busiest = max(range(nranks), key=lambda r: (seconds[r], -r))
    mean = sum(seconds) / nranks
    return Balance(compute, communicate, seconds, busiest, seconds[busiest] / mean if mean else 1.0)
