"""How the one-sided executor forms its GEMMs (``one_sided.products``), without MPI.

Every product a rank forms must equal numpy's for its rectangle, whether it was computed alone
or sliced from a merged GEMM; merging must happen exactly where the tiles (of local or fetched
pieces) cover one rectangle over one inner range.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from osmm_jax._src.planning import records
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, backward_plans
from osmm_jax._src.runtime import fetch, one_sided


def _local_requests(plan: Plan, rank: int):
    return [(m, m.rows) for m in plan.for_rank(rank).multiplies]


def _remote_pieces(plan: Plan, rank: int, a, b) -> dict:
    """What this rank's gets would fetch, keyed as the executor keys them, cut from the whole
    matrices."""
    remote = {}
    for m in plan.for_rank(rank).multiplies:
        if m.a_source != rank:
            remote[("A", m.rows, m.inner)] = a[m.rows[0] : m.rows[1], m.inner[0] : m.inner[1]]
        if m.b_source != rank:
            remote[("B", m.inner, m.cols)] = b[m.inner[0] : m.inner[1], m.cols[0] : m.cols[1]]
    return remote


def _check_products(plan: Plan, rank: int, a, b, requests, remote=None):
    local_a = np.asarray(plan.a.shard(a, rank))
    local_b = np.asarray(plan.b.shard(b, rank))
    parts = one_sided.products(plan, rank, local_a, local_b, requests, remote=remote or {})
    for (m, rows), part in zip(requests, parts):
        expected = (
            a[rows[0] : rows[1], m.inner[0] : m.inner[1]]
            @ b[m.inner[0] : m.inner[1], m.cols[0] : m.cols[1]]
        )
        np.testing.assert_allclose(np.asarray(part), expected, rtol=1e-5, atol=1e-5)
    return parts


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_weight_gradient_of_a_data_parallel_layer_is_one_gemm_per_rank(nranks):
    """dW = x.T @ dY of rows x replicated -> rows, as its plan runs: when staged, each rank's
    partials for every owner of the even split of dW share the rank's inner range and tile dW,
    and are one GEMM; unstaged, dW is one multiply already."""
    tokens, k, n = 60, 24, 16
    weights = [1 + r % 3 for r in range(nranks)]
    forward = Plan(
        Layout.rows((tokens, k), weights=weights),
        Layout.replicated((k, n), nranks=nranks),
        Layout.rows((tokens, n), weights=weights),
    )
    _, d_w = backward_plans(forward)
    stage = d_w.gather_stage if d_w.gather_stage is not None else d_w
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, tokens)).astype(np.float32)
    b = rng.standard_normal((tokens, n)).astype(np.float32)
    for rank in range(nranks):
        requests = _local_requests(stage, rank)
        # Staged (a gather stage for the replicated dW): one request per owner of its split.
        assert len(requests) == (nranks if stage is not d_w else 1)
        assert len(records.gemm_groups(requests)) == 1
        _check_products(stage, rank, a, b, requests)
        local_a, local_b = stage.a.shard(a, rank), stage.b.shard(b, rank)
        jaxpr = jax.make_jaxpr(
            lambda x, y, rank=rank, requests=requests: one_sided.products(
                stage, rank, x, y, requests, remote={}
            )
        )(local_a, local_b)
        assert str(jaxpr).count("dot_general") == 1


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_a_gathered_input_is_one_gemm_per_rank(nranks):
    """A split by rows (uneven) x B split by columns -> C split by columns (a column-parallel
    layer with sequence parallelism): each rank multiplies its own rows and the rows it
    fetched by its B block; the pieces tile its C block and are one GEMM, equal to numpy."""
    m, k, n = 30, 4, 8 * nranks  # fetching A's rows moves less than delivering C's
    plan = Plan(
        Layout.rows((m, k), weights=[1 + r for r in range(nranks)]),
        Layout.cols((k, n), nranks=nranks),
        Layout.cols((m, n), nranks=nranks),
    )
    rng = np.random.default_rng(2)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    for rank in range(nranks):
        requests = _local_requests(plan, rank)
        assert len(requests) == nranks  # one per owner of rows
        assert any(mm.a_source != rank for mm, _ in requests)
        assert len(records.gemm_groups(requests)) == 1
        remote = _remote_pieces(plan, rank, a, b)
        _check_products(plan, rank, a, b, requests, remote)
        local_a, local_b = plan.a.shard(a, rank), plan.b.shard(b, rank)
        jaxpr = jax.make_jaxpr(
            lambda x, y, rank=rank, requests=requests: one_sided.products(
                plan, rank, x, y, requests, remote=remote
            )
        )(local_a, local_b)
        assert str(jaxpr).count("dot_general") == 1


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_k_split_partial_over_gathered_rows_is_one_gemm(nranks):
    """dW = x.T @ dY of a sequence-parallel row layer (x split by features, dY by sequences,
    dW by features): each rank's one piece sums its own sequences and the ones it fetched; the
    inner ranges follow one another and are one GEMM, equal to numpy."""
    tokens, hidden, out = 30, 8 * nranks, 2  # fetching dY moves less than x or dW
    forward = Plan(
        Layout.cols((tokens, hidden), nranks=nranks),
        Layout.rows((hidden, out), nranks=nranks),
        Layout.rows((tokens, out), weights=[1 + r for r in range(nranks)]),
    )
    _, d_w = backward_plans(forward)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(d_w.a.shape).astype(np.float32)
    b = rng.standard_normal(d_w.b.shape).astype(np.float32)
    for rank in range(nranks):
        pieces = [(cell, cell.rows) for cell in one_sided._cells(d_w, rank)]
        assert len(pieces) == 1 and len(pieces[0][0].inner) == nranks
        local_a, local_b = d_w.a.shard(a, rank), d_w.b.shard(b, rank)
        remote = _remote_pieces(d_w, rank, a, b)

        def partials(x, y, rank=rank, pieces=pieces, remote=remote):
            multiplies = {(m.rows, m.inner, m.cols): m for m in d_w.multiplies_on(rank)}
            operands = one_sided._Operands(d_w, rank, x, y, remote, multiplies, np.float32)
            return one_sided._partials(operands, pieces)

        ((cell, rows),) = pieces
        (part,) = partials(local_a, local_b)
        expected = a[rows[0] : rows[1]] @ b[:, cell.cols[0] : cell.cols[1]]
        np.testing.assert_allclose(np.asarray(part), expected, rtol=1e-5, atol=1e-5)
        assert str(jax.make_jaxpr(partials)(local_a, local_b)).count("dot_general") == 1


@pytest.mark.parametrize("kinds", [("cols", "rows", "rows"), ("grid", "grid", "grid")])
def test_products_equal_numpy_for_every_rank_of_a_plan(kinds):
    """Plans whose ranks mix merged and single GEMMs over local and fetched pieces."""
    nranks, m, k, n = 4, 20, 28, 12
    make = {
        "rows": lambda shape: Layout.rows(shape, weights=[1, 2, 1, 3]),
        "cols": lambda shape: Layout.cols(shape, weights=[2, 1, 1, 1]),
        "grid": lambda shape: Layout.grid(shape, (2, 2)),
    }
    plan = Plan(make[kinds[0]]((m, k)), make[kinds[1]]((k, n)), make[kinds[2]]((m, n)))
    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    for rank in range(nranks):
        requests = [(mm, mm.rows) for mm in plan.for_rank(rank).multiplies]
        local = [(mm, rows) for mm, rows in requests if mm.a_source == mm.b_source == rank]
        _check_products(plan, rank, a, b, local)
        _check_products(plan, rank, a, b, requests, _remote_pieces(plan, rank, a, b))


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_partial_kept_and_delivered_is_never_cut_into_chunks(nranks):
    """A replicated C summed directly (the weight gradient of a data-parallel layer on 2 ranks;
    on more it is staged): each rank keeps its partial and delivers it to every other rank, as
    one piece however small the chunks; partials delivered only (a K-split) are cut into rows
    of about chunk_bytes."""
    tokens, k, n = 64, 32, 16
    dw = Plan(
        Layout.cols((k, tokens), nranks=nranks),
        Layout.rows((tokens, n), nranks=nranks),
        Layout.replicated((k, n), nranks=nranks),
    )
    k_split = Plan(
        Layout.cols((k, tokens), nranks=nranks),
        Layout.rows((tokens, n), nranks=nranks),
        Layout.rows((k, n), nranks=nranks),
    )
    assert (dw.gather_stage is None) == (nranks == 2)
    for rank in range(nranks):
        cells = one_sided._cells(dw, rank)
        if dw.gather_stage is None:
            assert all(c.local and c.deliveries for c in cells)
            chunks = one_sided._chunks(cells, 4, chunk_bytes=8)
            assert [[rows for _, rows in chunk] for chunk in chunks] == [[c.rows] for c in cells]
        delivered = [c for c in one_sided._cells(k_split, rank) if c.deliveries]
        assert not any(c.local for c in delivered)
        pieces = [p for chunk in one_sided._chunks(delivered, 4, chunk_bytes=8) for p in chunk]
        assert len(pieces) == sum(c.rows[1] - c.rows[0] for c in delivered)  # one row each


def test_fetched_pieces_are_cut_to_the_rectangles_the_multiplies_use():
    """The planner joins adjacent pieces from one owner into one get (a 2 x 1 x 2 split cuts
    a box's A piece along K where the other rank's B slice ends); the executor cuts each
    multiply's rectangle back out of the joined piece."""
    from osmm_jax._src.planning.work import three_d_layouts

    dims = (12, 36, 20)
    a_layout, b_layout, c_layout, work = three_d_layouts(dims, (2, 1, 2))
    plan = Plan(a_layout, b_layout, c_layout, work=work)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(dims[:2]).astype(np.float32)
    b = rng.standard_normal(dims[1:]).astype(np.float32)
    joined = 0
    for rank in range(4):
        gets = plan.for_rank(rank).gets
        pieces = {
            (t.matrix, t.rows, t.cols): (a if t.matrix == "A" else b)[
                t.rows[0] : t.rows[1], t.cols[0] : t.cols[1]
            ]
            for t in gets
        }
        remote = fetch.cut_to_multiplies(plan, rank, pieces)
        expected = _remote_pieces(plan, rank, a, b)
        assert remote.keys() == expected.keys()
        for key, piece in remote.items():
            np.testing.assert_array_equal(piece, expected[key])
        joined += len(expected) - len(gets)
    assert joined > 0, "this split must join pieces, or the test checks nothing"
