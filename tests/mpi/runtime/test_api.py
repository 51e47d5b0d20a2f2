"""plan(), gather(), stats() and the input checks that run before any MPI traffic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.planning.records import combine_facts

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def _row_plan(m=8, k=6, n=4):
    return om.plan(om.Layout.rows((m, k)), om.Layout.replicated((k, n)), om.Layout.rows((m, n)))


def _k_split_plan(n=8):
    return om.plan(om.Layout.cols((n, n)), om.Layout.rows((n, n)), om.Layout.rows((n, n)))


def test_plan_is_identical_on_every_rank_and_cached():
    plan = _k_split_plan()
    assert plan is _k_split_plan()
    fingerprints = MPI.COMM_WORLD.allgather(plan.fingerprint)
    assert len(set(fingerprints)) == 1
    assert len(plan.flops) == SIZE and sum(plan.flops) == 2 * 8**3
    assert "rank 0" in plan.describe()


@pytest.mark.parametrize(
    "method, sync, extra",
    [("one_sided", "fence", 3), ("one_sided", "notify", 4), ("allreduce", None, 5)],
)
def test_a_product_builds_only_this_ranks_part_of_its_plans(method, sync, extra):
    # Layouts never used by another test here, so that the plan is fresh: running the product
    # and its gradient builds this rank's part of each plan and agrees on the shared facts,
    # never the whole schedule, with either method and synchronisation (the notified fetch's
    # owners learn where their pieces go from the getters, not from the getters' plans).
    n = 8 * SIZE + extra
    plan = om.plan(
        om.Layout.cols((n, n)), om.Layout.rows((n, n)), om.Layout.grid((n, n), (SIZE, 1))
    )
    rng = np.random.default_rng(RANK)
    a = rng.standard_normal(plan.a.local_shape(RANK)).astype(np.float32)
    b = rng.standard_normal(plan.b.local_shape(RANK)).astype(np.float32)
    loss = lambda x, y: jnp.sum(om.matmul(x, y, plan, method=method, sync=sync) ** 2)  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b))
    for p in (plan, *plan.backward()):
        assert "_schedule" not in p.__dict__, "the whole schedule was built"
        assert set(p._rank_plans) == {RANK}
        everyone = MPI.COMM_WORLD.allgather(p.for_rank(RANK).facts)
        assert p.facts == combine_facts(everyone)
    # The whole plan, built on demand, agrees with the facts the ranks combined.
    assert plan._schedule_facts == plan.facts


def test_plan_rejects_layouts_for_another_rank_count():
    with pytest.raises(ValueError, match=f"communicator has {SIZE}"):
        om.plan(
            om.Layout.rows((4, 4), nranks=SIZE + 1),
            om.Layout.rows((4, 4), nranks=SIZE + 1),
            om.Layout.rows((4, 4), nranks=SIZE + 1),
        )


def test_plan_on_a_subcommunicator():
    sub = MPI.COMM_WORLD.Split(RANK % 2, RANK)
    n = sub.Get_size()
    layout_a = om.Layout.cols((6, 6), nranks=n)
    plan = om.plan(
        layout_a, om.Layout.rows((6, 6), nranks=n), om.Layout.rows((6, 6), nranks=n), comm=sub
    )
    a = np.arange(36.0).reshape(6, 6) + RANK % 2
    b = np.eye(6) * 2
    c = om.matmul(
        layout_a.shard(a, sub.Get_rank()).astype(np.float32),
        plan.b.shard(b, sub.Get_rank()).astype(np.float32),
        plan,
    )
    np.testing.assert_allclose(c, plan.c.shard(a @ b, sub.Get_rank()))
    sub.Free()


def test_gather_assembles_every_layout():
    x = np.arange(30.0).reshape(5, 6)
    for layout in (
        om.Layout.rows((5, 6), weights=[1 + r % 2 for r in range(SIZE)]),
        om.Layout.cols((5, 6)),
        om.Layout.replicated((5, 6)),
    ):
        np.testing.assert_array_equal(om.gather(layout.shard(x, RANK), layout), x)


def test_stats_has_counters():
    s = om.stats()
    for key in ("rma_ops", "rma_bytes", "accumulates", "puts", "gets", "windows", "window_bytes"):
        assert isinstance(s[key], int) and s[key] >= 0


# -- bad input: a clear ValueError/TypeError on every rank, never a hang ---------------


def test_wrong_local_shape_on_one_rank_fails_on_all_ranks():
    plan = _row_plan()
    a = np.ones(plan.a.local_shape(RANK), np.float32)
    b = np.ones(plan.b.local_shape(RANK), np.float32)
    bad_rank = SIZE - 1
    if RANK == bad_rank:
        a = np.ones((a.shape[0] + 1, a.shape[1]), np.float32)
    with pytest.raises(ValueError, match=rf"rank {bad_rank}: a_local has shape"):
        om.matmul(a, b, plan)
    with pytest.raises(ValueError, match=rf"rank {bad_rank}: a_local has shape"):
        jax.jit(lambda x, y: om.matmul(x, y, plan))(a, b)
    # Nothing was sent, nothing is stuck: the next product works.
    good = om.matmul(np.ones(plan.a.local_shape(RANK), np.float32), b, plan)
    np.testing.assert_allclose(good, 6.0)


def test_dtype_errors():
    plan = _row_plan()
    a = np.ones(plan.a.local_shape(RANK), np.float32)
    b = np.ones(plan.b.local_shape(RANK), np.float32)
    with pytest.raises(ValueError, match="a_local is float32 but b_local is float64"):
        om.matmul(a, b.astype(np.float64), plan)
    with pytest.raises(ValueError, match="dtype int32 is not supported"):
        om.matmul(a.astype(np.int32), b.astype(np.int32), plan)
    with pytest.raises(ValueError, match="method must be one of"):
        om.matmul(a, b, plan, method="two_sided")
    with pytest.raises(ValueError, match="chunk_bytes must be >= 0"):
        om.matmul(a, b, plan, chunk_bytes=-1)
    with pytest.raises(TypeError, match="plan must be an osmm_jax Plan"):
        om.matmul(a, b, "plan")


@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_ranks_that_disagree_on_the_plan_all_get_an_error():
    weights = [2.0 if (r == 0 and RANK == 0) else 1.0 for r in range(SIZE)]
    plan = om.plan(
        om.Layout.rows((8, 4), weights=weights),
        om.Layout.replicated((4, 4)),
        om.Layout.rows((8, 4), weights=weights),
    )
    a = np.ones(plan.a.local_shape(RANK), np.float32)
    b = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match=r"ranks disagree.*ranks \[0\] have"):
        om.matmul(a, b, plan)


@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_ranks_that_disagree_on_the_method_all_get_an_error():
    plan = _k_split_plan()
    a = np.ones(plan.a.local_shape(RANK), np.float32)
    b = np.ones(plan.b.local_shape(RANK), np.float32)
    with pytest.raises(ValueError, match="ranks disagree"):
        om.matmul(a, b, plan, method="one_sided" if RANK else "allreduce")


def test_environment_selects_the_allreduce_default(monkeypatch):
    plan = _k_split_plan()
    a = jnp.ones(plan.a.local_shape(RANK), jnp.float32)
    b = jnp.ones(plan.b.local_shape(RANK), jnp.float32)
    monkeypatch.setenv("OSMM_USE_ALLREDUCE", "1")
    before = om.stats()["rma_ops"]
    c = om.matmul(a, b, plan)
    assert om.stats()["rma_ops"] == before, "the allreduce method issues no RMA"
    np.testing.assert_allclose(c, 8.0)


def test_a_freed_communicators_handle_reused_by_a_new_one_gets_a_fresh_duplicate():
    first = MPI.COMM_WORLD.Dup()
    dup_of_first = om.plan(
        om.Layout.rows((4, 4)), om.Layout.replicated((4, 4)), om.Layout.rows((4, 4)), comm=first
    )
    first.Free()
    second = MPI.COMM_WORLD.Split(0, SIZE - 1 - RANK)  # reversed rank order: a different group
    plan = om.plan(
        om.Layout.rows((4, 4)), om.Layout.replicated((4, 4)), om.Layout.rows((4, 4)), comm=second
    )
    assert plan.comm_key != dup_of_first.comm_key or SIZE == 1
    from osmm_jax._src.runtime.communicators import comm_for_key

    assert comm_for_key(plan.comm_key).Get_rank() == second.Get_rank()
    a = np.full(plan.a.local_shape(second.Get_rank()), 1.0, np.float32)
    c = om.matmul(a, np.eye(4, dtype=np.float32), plan)
    np.testing.assert_allclose(c, 1.0)
    second.Free()


def test_memory_budgets_gathers_each_ranks_own(monkeypatch):
    monkeypatch.setenv("OSMM_MEMORY_BUDGET", f"{RANK + 1} GiB")  # each rank states its own
    assert om.memory_budgets() == tuple(float((r + 1) << 30) for r in range(SIZE))
    per_rank = ",".join(f"{64 * (r + 1)}MiB" for r in range(SIZE))
    monkeypatch.setenv("OSMM_MEMORY_BUDGET", per_rank)
    assert om.memory_budgets() == tuple(float((64 * (r + 1)) << 20) for r in range(SIZE))
    monkeypatch.delenv("OSMM_MEMORY_BUDGET")
    budgets = om.memory_budgets()
    assert len(budgets) == SIZE and all(0 < b < float("inf") for b in budgets)
    assert budgets[RANK] == om._src.runtime.api.local_memory_budget()


def test_a_bad_memory_budget_on_one_rank_raises_on_every_rank(monkeypatch):
    if RANK == SIZE - 1:
        monkeypatch.setenv("OSMM_MEMORY_BUDGET", "plenty")
    else:
        monkeypatch.setenv("OSMM_MEMORY_BUDGET", "1GiB")
    with pytest.raises(ValueError, match=f"rank {SIZE - 1}: OSMM_MEMORY_BUDGET must be a number"):
        om.memory_budgets()
    monkeypatch.setenv("OSMM_MEMORY_BUDGET", ",".join(["1GiB"] * (SIZE + 1)))
    with pytest.raises(ValueError, match=f"has {SIZE + 1} budgets but the communicator has"):
        om.memory_budgets()


def _release_cases():
    """Products that keep windows: a notified K-split reduce with its gradients (the dB of a
    K-split fetches), a fenced data-parallel product, a notified fetch of B's rows."""
    m, k, n = 4 * SIZE + 3, 6 * SIZE + 2, 5
    return {
        "k_split": om.plan(om.Layout.cols((m, k)), om.Layout.rows((k, n)), om.Layout.rows((m, n))),
        "replicated": om.plan(
            om.Layout.cols((m, k)), om.Layout.rows((k, n)), om.Layout.replicated((m, n))
        ),
        "fetch": om.plan(om.Layout.rows((m, k)), om.Layout.rows((k, n)), om.Layout.rows((m, n))),
    }


def _release_step(plan, sync, x, y):
    def loss(a, b):
        return jnp.sum(jnp.sin(om.matmul(a, b, plan, sync=sync)))

    step = jax.jit(lambda a, b: (om.matmul(a, b, plan, sync=sync), jax.grad(loss, (0, 1))(a, b)))
    return jax.tree.map(np.asarray, step(x, y))


@pytest.mark.parametrize("defer", ["0", "1"])
def test_release_frees_every_window_and_the_next_products_give_the_same_bits(defer, monkeypatch):
    monkeypatch.setenv("OSMM_DEFER", defer)
    rng = np.random.default_rng(11)
    steps = []
    for plan, sync in zip(_release_cases().values(), ["notify", "fence", "notify"]):
        x = plan.a.shard(rng.standard_normal(plan.a.shape).astype(np.float32), RANK)
        y = plan.b.shard(rng.standard_normal(plan.b.shape).astype(np.float32), RANK)
        steps.append((plan, sync, x, y))
    om.release()  # windows of earlier tests' products, sized by them
    before = [_release_step(*s) for s in steps]
    held = om.stats()["window_bytes"]
    assert held > 0 or SIZE == 1  # one rank runs every product locally
    assert om.release() == held
    assert om.stats()["windows"] == 0 and om.stats()["window_bytes"] == 0
    assert om.release() == 0  # nothing left: a second call frees nothing and waits for nobody
    for _ in range(2):  # the windows are created again, then reused
        after = [_release_step(*s) for s in steps]
        for (_, sync, _, _), old, new in zip(steps, before, after):
            for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
                if sync == "notify":  # the notified sum's order is fixed: the same bits
                    assert x.tobytes() == y.tobytes()
                else:  # fenced accumulates land in any order
                    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert om.stats()["window_bytes"] == held
    for (plan, _, x, y), (c, _) in zip(steps, before):
        a, b = om.gather(x, plan.a), om.gather(y, plan.b)
        np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
