"""Hypothesis strategies for layouts, shared by the planner and layout tests."""

from __future__ import annotations

from hypothesis import strategies as st

from osmm_jax._src.planning.layout import Layout

KINDS = ("rows", "cols", "grid", "replicated")


@st.composite
def weights(draw, parts: int):
    """Non-negative weights, at least one positive, sometimes with zeros (empty blocks)."""
    ws = draw(
        st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 3.7]), min_size=parts, max_size=parts)
    )
    if not any(ws):
        ws[draw(st.integers(0, parts - 1))] = 1.0
    return ws


@st.composite
def layouts(draw, shape, nranks: int, kinds=KINDS):
    """Any layout of ``shape`` over ``nranks`` ranks, with uneven (possibly empty) blocks."""
    kind = draw(st.sampled_from(kinds))
    if kind == "rows":
        return Layout.rows(shape, weights=draw(weights(nranks)))
    if kind == "cols":
        return Layout.cols(shape, weights=draw(weights(nranks)))
    if kind == "replicated":
        return Layout.replicated(shape, nranks=nranks)
    divisors = [d for d in range(1, nranks + 1) if nranks % d == 0]
    pr = draw(st.sampled_from(divisors))
    pc = nranks // pr
    row_w, col_w = draw(weights(pr)), draw(weights(pc))
    if draw(st.booleans()):
        return Layout.grid(shape, (pr, pc), row_weights=row_w, col_weights=col_w)
    # A transposed grid: ranks numbered down the columns instead of along the rows.
    return Layout.grid(shape[::-1], (pc, pr), row_weights=col_w, col_weights=row_w).T


@st.composite
def products(draw, max_dim: int = 9, max_ranks: int = 5):
    """(A, B, C) layouts of one product with random dimensions, rank count and kinds."""
    nranks = draw(st.integers(1, max_ranks))
    m, k, n = (draw(st.integers(0, max_dim)) for _ in range(3))
    a = draw(layouts((m, k), nranks))
    b = draw(layouts((k, n), nranks))
    c = draw(layouts((m, n), nranks))
    return a, b, c


@st.composite
def works(draw, dims, nranks: int):
    """A :class:`Work` split of an ``M x K x N`` product over ``nranks`` ranks: any grid whose
    size is ``nranks``, uneven (possibly empty) boxes, ranks in any order."""
    from osmm_jax._src.planning.work import Work

    divisors = [d for d in range(1, nranks + 1) if nranks % d == 0]
    pm = draw(st.sampled_from(divisors))
    pk = draw(st.sampled_from([d for d in divisors if (nranks // pm) % d == 0]))
    pn = nranks // (pm * pk)
    ranks = draw(st.permutations(range(nranks)))
    return Work.grid(
        dims, (pm, pk, pn), draw(weights(pm)), draw(weights(pk)), draw(weights(pn)), ranks=ranks
    )


@st.composite
def worked_products(draw, max_dim: int = 9, max_ranks: int = 6):
    """(A, B, C, work): layouts of one product as :func:`products` (nothing replicated, or
    anything) and a :class:`Work` split of it."""
    a, b, c = draw(products(max_dim=max_dim, max_ranks=max_ranks))
    (m, k), n = a.shape, b.shape[1]
    return a, b, c, draw(works((m, k, n), a.nranks))
