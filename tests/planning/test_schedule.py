"""The records a plan's cells make: every piece got once and needed, partials summed per
rectangle and put where they land alone, targets rotated by origin, the collector restored."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from strategies import products

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import make_plan
from osmm_jax._src.planning.records import LocalUpdate, Transfer


def _size(iv):
    return iv[1] - iv[0]


def _inside(rows, cols, get) -> bool:
    """Whether the rectangle ``rows x cols`` lies in ``get``'s ``(.., .., rows, cols, ..)``."""
    return (
        get[2][0] <= rows[0]
        and rows[1] <= get[2][1]
        and get[3][0] <= cols[0]
        and cols[1] <= get[3][1]
    )


@settings(max_examples=300, deadline=None)
@given(products())
def test_transfers_are_needed_and_well_formed(layouts):
    plan = make_plan(*layouts)
    needed = set()
    for m in plan.multiplies:
        assert plan.a.owners(m.rows, m.inner), "A piece must lie inside one block"
        assert m.a_source in plan.a.owners(m.rows, m.inner)
        assert m.b_source in plan.b.owners(m.inner, m.cols)
        if m.a_source != m.rank:
            needed.add((m.rank, "A", m.rows, m.inner, m.a_source))
        if m.b_source != m.rank:
            needed.add((m.rank, "B", m.inner, m.cols, m.b_source))
    gets = [
        (t.origin, t.matrix, t.rows, t.cols, t.target)
        for t in plan.transfers
        if t.op == "get" and t.matrix != "C"
    ]
    assert len(gets) == len(set(gets)), "the same piece is fetched twice"

    # Adjacent pieces from one owner are joined into one get: each needed piece lies in
    # exactly one get from its owner, and each get is tiled by the pieces it holds.
    def held_by(get):
        origin, matrix, _, _, owner = get
        return [
            piece
            for piece in needed
            if (piece[0], piece[1], piece[4]) == (origin, matrix, owner)
            and _inside(piece[2], piece[3], get)
        ]

    holders = Counter(piece for get in gets for piece in held_by(get))
    assert set(holders) == needed, "every remote piece is fetched"
    assert all(count == 1 for count in holders.values()), "no piece is fetched twice"
    for get in gets:
        area = sum(_size(piece[2]) * _size(piece[3]) for piece in held_by(get))
        assert area == _size(get[2]) * _size(get[3]), "every fetched element feeds a multiply"
    computed = {(m.rank, m.rows, m.inner, m.cols) for m in plan.multiplies}
    receivers = {}
    for t in plan.transfers:
        assert t.origin != t.target
        assert 0 <= t.origin < plan.nranks and 0 <= t.target < plan.nranks
        if t.op == "get":
            continue
        assert t.matrix == "C" and t.op in ("put", "accumulate")
        for k in t.inner:
            assert (t.origin, t.rows, k, t.cols) in computed
        receivers.setdefault((t.target, t.rows, t.cols), []).append(t)
    for ts in receivers.values():
        # The target's own partial is added outside the window, so it may have one too.
        assert {t.op for t in ts} == ({"put"} if len(ts) == 1 else {"accumulate"}), (
            "a rectangle's only delivery is a put, and only then"
        )


def test_transfers_rotate_targets_by_origin():
    n = 12
    plan = make_plan(
        Layout.cols((n, n), nranks=3), Layout.rows((n, n), nranks=3), Layout.rows((n, n), nranks=3)
    )
    for origin in range(3):
        targets = [t.target for t in plan.transfers if t.origin == origin]
        assert targets == [(origin + 1) % 3, (origin + 2) % 3]


def test_example_schedule_gets_once_and_sums_partials_per_rectangle(example_layouts):
    plan = make_plan(*example_layouts)
    assert plan.transfers == (
        Transfer("get", "A", 0, 1, (1, 4), (0, 2)),
        Transfer("get", "A", 1, 0, (0, 1), (2, 6)),  # once, for two cells
        Transfer("get", "B", 1, 0, (0, 2), (3, 5)),
        # Each rectangle receives one partial (its owner's own is added outside the window).
        Transfer("put", "C", 0, 1, (0, 1), (3, 5), ((0, 2),)),
        Transfer("put", "C", 1, 0, (0, 1), (0, 3), ((2, 6),)),
        Transfer("put", "C", 1, 0, (1, 4), (0, 3), ((2, 6),)),
    )
    assert plan.local_updates == (
        LocalUpdate(0, (0, 1), (0, 3), ((0, 2),)),
        LocalUpdate(0, (1, 4), (0, 3), ((0, 2),)),
        LocalUpdate(1, (0, 1), (3, 5), ((2, 6),)),
        LocalUpdate(1, (1, 4), (3, 5), ((0, 2), (2, 6))),
    )
    assert [(m.rank, m.rows, m.inner, m.cols, m.a_source, m.b_source) for m in plan.multiplies] == [
        (0, (0, 1), (0, 2), (0, 3), 0, 0),
        (0, (0, 1), (0, 2), (3, 5), 0, 0),
        (0, (1, 4), (0, 2), (0, 3), 1, 0),
        (1, (0, 1), (2, 6), (0, 3), 0, 1),
        (1, (0, 1), (2, 6), (3, 5), 0, 1),
        (1, (1, 4), (0, 2), (3, 5), 1, 0),
        (1, (1, 4), (2, 6), (0, 3), 1, 1),
        (1, (1, 4), (2, 6), (3, 5), 1, 1),
    ]
    assert sum(plan.flops) == 2 * 4 * 6 * 5


def test_a_product_with_one_k_cell_puts_and_rotates_targets():
    # Rank 2 holds all of A and B and computes every row of C: row 0 is rank 0's, row 1
    # rank 1's, each the only contribution to its rectangle (one K cell), so a put; rank 2's
    # deliveries start at the next rank (0), then 1.
    a = Layout.rows((2, 1), sizes=[0, 0, 2])
    b = Layout.rows((1, 1), sizes=[0, 0, 1])
    c = Layout.rows((2, 1), sizes=[1, 1, 0])
    plan = make_plan(a, b, c)
    assert plan.transfers == (
        Transfer("put", "C", 2, 0, (0, 1), (0, 1), ((0, 1),)),
        Transfer("put", "C", 2, 1, (1, 2), (0, 1), ((0, 1),)),
    )
    assert plan.local_updates == ()


def test_collector_is_restored_after_planning():
    import gc

    make_plan(
        Layout.rows((4, 4), nranks=2), Layout.cols((4, 4), nranks=2), Layout.rows((4, 4), nranks=2)
    )
    assert gc.isenabled()
    gc.disable()
    try:
        Plan = type(
            make_plan(
                Layout.rows((4, 4), nranks=2),
                Layout.rows((4, 4), nranks=2),
                Layout.rows((4, 4), nranks=2),
            )
        )
        Plan(
            Layout.rows((6, 4), nranks=2),
            Layout.rows((4, 4), nranks=2),
            Layout.rows((6, 4), nranks=2),
        )
        assert not gc.isenabled()
    finally:
        gc.enable()
