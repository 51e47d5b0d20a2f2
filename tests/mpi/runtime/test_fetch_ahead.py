"""Fetches ahead (``OSMM_FETCH_AHEAD``; by default where a rank gets at most
``slots.FETCH_AHEAD_MAX_ELEMENTS``): a product's notified fetch is finished by a waiter
thread, and the GEMMs on a rank's own pieces do not wait for it.

In the compiled program the GEMM on this rank's own pieces reads nothing the fetch returns
(fetched in place, the same product is one GEMM over own and fetched pieces joined, after the
fetch); the products and their gradients are right with either transport and every dtype, the
same bits run after run and the same as in place up to the last bits of a GEMM of another
shape; a rank late to its product delays only the GEMMs that read its pieces; and a fetch ahead
is counted in ``stats()["fetches_ahead"]``, not as a deferred reduce; a setting that differs
between ranks is refused on every rank.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src import config

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
# Few columns of A and many of B, so that the planner fetches rows of A rather than columns of
# B (whose partials it would then deliver): the all-gather of a sequence-parallel layer.
M, K, N = 6 * SIZE + 5, 7, 12 * SIZE + 3
pytestmark = pytest.mark.ranks(1, 2, 3, 4)


def _sequence_parallel():
    """A sequence-parallel column layer's product: the rows of ``x`` split unevenly, the
    kernel and the result by columns, so every rank needs every other rank's rows."""
    rows = [4 + 2 * r for r in range(SIZE)]
    rows[-1] += M - sum(rows)
    return om.plan(
        om.Layout.rows((M, K), sizes=rows), om.Layout.cols((K, N)), om.Layout.cols((M, N))
    )


def _grid():
    """Rows of A against columns of B into a grid: the planner fetches and delivers."""
    shape = (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)
    return om.plan(om.Layout.rows((M, K)), om.Layout.cols((K, N)), om.Layout.grid((M, N), shape))


PLANS = {"sequence_parallel": _sequence_parallel, "grid": _grid}


def _blocks(plan, dtype, seed=3):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal(plan.a.shape), rng.standard_normal(plan.b.shape)
    a, b = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (a, b))  # representable
    a_loc, b_loc = (jnp.asarray(x, dtype) for x in (plan.a.shard(a, RANK), plan.b.shard(b, RANK)))
    return a, b, a_loc, b_loc


def _with_setting(monkeypatch, ahead: bool, make):
    """``make()`` with ``OSMM_FETCH_AHEAD`` set so (a product reads it when it is traced)."""
    monkeypatch.setenv(config.FETCH_AHEAD, "1" if ahead else "0")
    monkeypatch.setenv(config.SYNC, "notify")
    try:
        return make()
    finally:
        monkeypatch.delenv(config.FETCH_AHEAD)


def _hlo(monkeypatch, ahead: bool, fn, *args) -> str:
    """The compiled module of ``jax.jit(fn)`` for ``args``, traced with the fetch ahead or in
    place (a function of its own: JAX would reuse a trace made under the other setting)."""
    return _with_setting(
        monkeypatch, ahead, lambda: jax.jit(lambda *xs: fn(*xs)).lower(*args).compile().as_text()
    )


def _traced(monkeypatch, ahead: bool, fn, *args):
    """``jax.jit(fn)``, traced (by a first call) with the fetch ahead or in place, and the
    first call's result."""
    jitted = jax.jit(lambda *xs: fn(*xs))
    first = _with_setting(monkeypatch, ahead, lambda: jax.tree.map(np.asarray, jitted(*args)))
    return jitted, first


def _dots_after_the_fetch(hlo: str) -> list[bool]:
    """For each GEMM of the compiled entry computation ``hlo`` (a ``dot``, or a fusion made of
    a ``dot_general``): whether it reads, directly or through other instructions, what a
    fetch (a custom call ``osmm_reduce_finish*``, a notified round's finish) returned. Not
    empty: a module without a GEMM or without a fetch is a failure of the check itself."""
    entry = hlo[hlo.index("\nENTRY ") :]
    reads, gemms, fetches = {}, [], set()
    for line in entry.splitlines()[1:]:
        found = re.match(r"\s*(?:ROOT )?%(\S+) = .*?\b([\w-]+)\((.*)", line)
        if found is None:
            continue
        name, op, rest = found.groups()
        reads[name] = set(re.findall(r"%([\w.\-]+)", rest.split("), ")[0]))
        if op == "dot" or (op == "fusion" and 'op_name="jit(<lambda>)/dot_general"' in line):
            gemms.append(name)
        target = re.search(r'custom_call_target="(\w+)"', line)
        if op == "custom-call" and target and target.group(1).startswith("osmm_reduce_finish"):
            fetches.add(name)
    assert gemms and fetches, (gemms, fetches)

    known: dict[str, bool] = {}

    def after_fetch(name: str) -> bool:
        if name not in known:
            known[name] = False  # the graph has no cycles; this only ends a repeated visit
            known[name] = name in fetches or any(after_fetch(r) for r in reads.get(name, ()))
        return known[name]

    return [after_fetch(g) for g in gemms]


@pytest.mark.ranks(min=2, reason="pieces fetched from other ranks")
def test_the_gemm_on_own_rows_does_not_wait_for_a_fetch_ahead(monkeypatch):
    plan = _sequence_parallel()
    _, _, a_loc, b_loc = _blocks(plan, jnp.float32)

    def product(x, y):
        return om.matmul(x, y, plan)

    ahead = _hlo(monkeypatch, True, product, a_loc, b_loc)
    in_place = _hlo(monkeypatch, False, product, a_loc, b_loc)
    assert "osmm_reduce_finish_deferred" in ahead and "osmm_reduce_finish_deferred" not in in_place
    waits = _dots_after_the_fetch(ahead)
    # Ahead: one GEMM reads only this rank's rows, the others wait for the fetched ones.
    assert waits.count(False) >= 1 and waits.count(True) >= 1, waits
    # In place, the rows are joined first: every GEMM reads the fetched buffer.
    assert all(_dots_after_the_fetch(in_place)), in_place


@pytest.mark.parametrize("transport", ["rma", "messages"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_products_and_gradients_fetched_ahead_are_right(name, dtype, transport, monkeypatch):
    jax.config.update("jax_enable_x64", True)
    monkeypatch.setenv(config.TRANSPORT, transport)
    monkeypatch.setenv(config.DEFER, "0")  # the gradients' deliveries in place: counted apart
    plan = PLANS[name]()
    a, b, a_loc, b_loc = _blocks(plan, dtype)

    def step(x, y):
        value, grads = jax.value_and_grad(
            lambda x, y: jnp.sum(jnp.sin(om.matmul(x, y, plan))),
            argnums=(0, 1),
        )(x, y)
        return om.matmul(x, y, plan), value, grads

    ahead, first = _traced(monkeypatch, True, step, a_loc, b_loc)
    _, expected_in_place = _traced(monkeypatch, False, step, a_loc, b_loc)
    before = om.stats()
    runs = [first] + [jax.tree.map(np.asarray, ahead(a_loc, b_loc)) for _ in range(2)]
    after = om.stats()
    for run in runs[1:]:  # the same bits, run after run
        assert all(
            x.tobytes() == y.tobytes()
            for x, y in zip(jax.tree.leaves(run), jax.tree.leaves(runs[0]))
        )
    # 16-bit: the cotangent too is rounded to bfloat16 before the backward products.
    tolerance = {jnp.float64: 1e-12, jnp.float32: 1e-4, jnp.bfloat16: 1e-1}[dtype]
    c = runs[0][0].astype(np.float64)
    np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=tolerance, atol=tolerance)
    dc = np.cos(a @ b)
    expected_grads = (plan.a.shard(dc @ b.T, RANK), plan.b.shard(a.T @ dc, RANK))
    for got, want in zip(runs[0][2], expected_grads):
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance, atol=tolerance)
    for got, want in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(expected_in_place)):
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance
        )
    ahead_count = after["fetches_ahead"] - before["fetches_ahead"]
    assert after["deferred_reduces"] == before["deferred_reduces"]  # a fetch is not one
    if SIZE == 1:
        assert ahead_count == 0  # nothing to fetch
    elif name == "sequence_parallel":
        assert ahead_count >= 2, ahead_count  # the forward product's fetch, every run
    assert sum(COMM.allgather(ahead_count)) > 0 or SIZE == 1


@pytest.mark.ranks(min=2, reason="a rank late to its product")
def test_a_rank_late_to_a_fetch_ahead_delays_only_the_gemms_that_read_its_rows(monkeypatch):
    """Rank 0's input comes from a slow host callback: the others' fetches wait for its rows
    on their waiters, and their results are right."""
    plan = _sequence_parallel()
    a, b, a_loc, b_loc = _blocks(plan, jnp.float32)

    def late(x):
        if RANK == 0:
            time.sleep(0.3)
        return x

    def program(x, y):
        x = jax.pure_callback(late, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return [om.matmul(s * x, y, plan) for s in (1.0, 2.0)]

    compiled, _ = _traced(monkeypatch, True, program, a_loc, b_loc)
    before = om.stats()["fetches_ahead"]
    for _ in range(2):
        for s, c in zip((1.0, 2.0), compiled(a_loc, b_loc)):
            np.testing.assert_allclose(
                np.asarray(c), plan.c.shard((s * a) @ b, RANK), rtol=1e-4, atol=1e-4
            )
    assert om.stats()["fetches_ahead"] - before == 4


@pytest.mark.ranks(min=2, reason="ranks set differently")
def test_a_setting_on_one_rank_only_is_refused_on_every_rank(monkeypatch):
    """``OSMM_FETCH_AHEAD`` set on rank 0 only: every rank gets the same clear error when the
    product is traced, before any MPI traffic of the product, and a product set alike runs."""
    plan = _sequence_parallel()
    a, b, a_loc, b_loc = _blocks(plan, jnp.float32)
    with pytest.raises(ValueError, match="ranks disagree"):
        _traced(monkeypatch, RANK == 0, lambda x, y: om.matmul(x, y, plan), a_loc, b_loc)
    _, c = _traced(monkeypatch, True, lambda x, y: om.matmul(x, y, plan), a_loc, b_loc)
    np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
