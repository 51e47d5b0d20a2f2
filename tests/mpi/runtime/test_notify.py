"""The notified reduce (``sync="notify"``, xla_ffi/notified/notify.h): bit-identical results run to run
and on every rank holding a copy, the same bits whatever the slot budget, slots reused safely
by products back to back with one rank late (credits pushed by targets or pulled by origins),
and the same values as the fence mode; and the notified fetch (A and B pieces pushed by their
owners, runtime/fetch.py): the fenced product's bits, without a fence or a get.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import default_sync

import osmm_jax as om
from benchmarks import pages
from osmm_jax._src import config, dtypes
from osmm_jax._src.runtime import communicators, native, one_sided, slots
from osmm_jax._src.runtime.matmul import _resolve_sync

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
REPEATS = 20
_NOTIFY = slots.Sync("notify")


def _cases():
    """Products whose blocks receive partials from several ranks: (layouts, work or None)."""
    M, K, N = 45, 96, 38
    cases = {
        "k_split": (om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N)), None),
        "grid": (
            om.Layout.cols((M, K)),
            om.Layout.rows((K, N)),
            om.Layout.grid((M, N), (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)),
            None,
        ),
        "data_parallel": (
            om.Layout.cols((M, K)),
            om.Layout.rows((K, N)),
            om.Layout.replicated((M, N)),
            None,
        ),
    }
    if SIZE == 4:  # boxes of a 1 x 2 x 2 grid: each C slice summed over two ranks
        cases["three_d"] = om.three_d_layouts((M, K, N), (1, 2, 2))
    # B's pieces pushed by their owners; the gradient of B is a K-split, that of A fetches too.
    cases["fetch"] = _fetch_case("rows")
    return cases


def _blocks(layouts, seed=3):
    rng = np.random.default_rng(seed)
    la, lb = layouts[0], layouts[1]
    a = rng.standard_normal(la.shape).astype(np.float32)
    b = rng.standard_normal(lb.shape).astype(np.float32)
    return a, b, la.shard(a, RANK), lb.shard(b, RANK)


@pytest.fixture(params=["push", "pull"])
def credits(request, monkeypatch):
    """How origins learn that their slots are free: pushed by the targets (the default), or
    read from them, as under an MPI whose RMA calls wait for the target (Open MPI)."""
    pull = request.param == "pull"
    monkeypatch.setattr(communicators, "accumulates_wait_for_target", lambda: pull)
    return request.param


@pytest.fixture
def staged(monkeypatch):
    """Every replicated C staged (reduce-scatter, then the notified all-gather), however small,
    whichever the transport."""
    monkeypatch.setattr(slots, "DIRECT_EXTRA_ELEMENTS", 0)
    monkeypatch.setattr(slots, "DIRECT_EXTRA_ELEMENTS_MESSAGES", 0)


def _plan(case):
    a, b, c, work = case
    return om.plan(a, b, c, work=work) if work is not None else om.plan(a, b, c)


@pytest.mark.ranks(min=2, reason="partials from several ranks")
@pytest.mark.parametrize("name", ["k_split", "grid", "data_parallel", "staged", "three_d", "fetch"])
def test_repeated_products_and_gradients_are_bit_identical(name, request):
    cases = _cases()
    if name == "staged":  # the data-parallel product, reduce-scattered then gathered
        if SIZE < 3:
            pytest.skip("a replicated C is staged from 3 ranks on")
        request.getfixturevalue("staged")
        cases[name] = cases["data_parallel"]
    if name not in cases:
        pytest.skip("the 3-D case runs on 4 ranks")
    plan = _plan(cases[name])
    assert (name == "staged") == (slots.executed_plan(plan, _NOTIFY) is plan.gather_stage)
    a, b, a_loc, b_loc = _blocks(cases[name])

    def loss(x, y):
        return jnp.sum(jnp.sin(om.matmul(x, y, plan, sync="notify")))

    step = jax.jit(
        lambda x, y: (om.matmul(x, y, plan, sync="notify"), jax.grad(loss, (0, 1))(x, y))
    )
    runs = [jax.tree.map(np.asarray, step(a_loc, b_loc)) for _ in range(REPEATS)]
    first = jax.tree.leaves(runs[0])
    for run in runs[1:]:
        for x, y in zip(first, jax.tree.leaves(run)):
            assert x.tobytes() == y.tobytes()
    np.testing.assert_allclose(first[0], plan.c.shard(a @ b, RANK), rtol=2e-5, atol=2e-4)
    if plan.c.is_replicated:  # every rank holds the same bits
        assert len(set(COMM.allgather(first[0].tobytes()))) == 1


@pytest.mark.ranks(min=3, reason="several origins per target")
@pytest.mark.parametrize("name", ["k_split", "staged"])
def test_a_slot_budget_of_one_slot_sums_in_rounds_with_the_same_bits(
    name, monkeypatch, credits, request
):
    if name == "staged":  # the all-gather's origins too
        request.getfixturevalue("staged")
    case = _cases()["data_parallel" if name == "staged" else "k_split"]
    plan = _plan(case)
    _, _, a_loc, b_loc = _blocks(case)
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    folds = om.stats()["accumulator_folds"]
    unlimited = np.asarray(product(a_loc, b_loc))
    assert om.stats()["accumulator_folds"] == folds  # a slot per origin: the slots hold the sum
    monkeypatch.setenv(config.SLOT_BUDGET, "1")  # one byte: a single slot, one round per origin
    rounds = np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(a_loc, b_loc))
    assert unlimited.tobytes() == rounds.tobytes()
    assert om.stats()["slot_window_bytes"] == 2 * _slot_bytes(plan)  # accumulator + one slot
    # The accumulator is used exactly where the memory model counts it resident: the sum of
    # the origins below this rank outlives its round (the one slot) when another origin follows.
    sync = slots.Sync("notify", slot_budget=1, credits=credits)
    executed = slots.executed_plan(plan, sync)
    origins = executed.for_rank(RANK).origins
    expected = any(o < RANK for o in origins) and len(origins) > 1
    assert slots._accumulates(slots.notify_attribute(executed, RANK, 4, sync), RANK) == expected
    assert om.stats()["accumulator_folds"] - folds == int(expected)


def _slot_bytes(plan) -> int:
    """float32 bytes of the largest C block, aligned: of a staged plan, the largest block of
    its even split, which its reduce-scatter sums and its all-gather places (row splits)."""
    c = plan.c if plan.gather_stage is None else plan.gather_stage.c
    largest = max(int(np.prod(c.local_shape(r))) for r in range(SIZE))
    return -(-largest * 4 // 64) * 64


@pytest.mark.ranks(min=3, reason="origins that run ahead of a late target")
def test_products_back_to_back_with_a_late_target_reuse_the_slots_safely(credits, monkeypatch):
    """Ranks 1.. only deliver (rank 0 owns C, then rank 1 does, alternately), so they run
    ahead of rank 0, which sleeps before every product: their next deliveries must wait for
    its slots (deferred), and the rank whose target changes reads the target's progress (with
    pulled credits, every origin reads it, and no target writes into an origin's window).
    Credits are the RMA transport's (messages need none)."""
    monkeypatch.setenv("OSMM_TRANSPORT", "rma")
    M, K, N = 24, 10 * SIZE, 16
    on = [[M if r == owner else 0 for r in range(SIZE)] for owner in (0, 1)]
    plans = [
        om.plan(om.Layout.cols((M, K)), om.Layout.rows((K, N)), om.Layout.rows((M, N), sizes=s))
        for s in on
    ]
    products = [jax.jit(lambda x, y, p=p: om.matmul(x, y, p, sync="notify")) for p in plans]
    before = om.stats()
    rng = np.random.default_rng(11)
    for i in range(8):
        plan = plans[i % 2]
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((K, N)).astype(np.float32)
        if RANK == 0:
            time.sleep(0.2)
        c = np.asarray(products[i % 2](plan.a.shard(a, RANK), plan.b.shard(b, RANK)))
        np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    after = om.stats()
    deferred = after["deferred_deliveries"] - before["deferred_deliveries"]
    reads = after["credit_reads"] - before["credit_reads"]
    pushes = after["credit_pushes"] - before["credit_pushes"]
    assert COMM.allreduce(deferred) > 0
    assert COMM.allreduce(reads) > 0
    assert (COMM.allreduce(pushes) > 0) == (credits == "push")


@pytest.mark.ranks(min=2, reason="partials from several ranks")
@pytest.mark.parametrize("chunk_bytes", [0, 256])
def test_notify_and_fence_agree(chunk_bytes):
    case = _cases()["k_split"]
    plan = _plan(case)
    _, _, a_loc, b_loc = _blocks(case)
    results = {
        sync: np.asarray(
            jax.jit(lambda x, y, s=sync: om.matmul(x, y, plan, sync=s, chunk_bytes=chunk_bytes))(
                a_loc, b_loc
            )
        )
        for sync in config.SYNC_MODES
    }
    np.testing.assert_allclose(results["notify"], results["fence"], rtol=1e-5, atol=1e-5)


def test_sync_is_checked_on_every_rank():
    plan = om.plan(om.Layout.rows((4, 4)), om.Layout.replicated((4, 4)), om.Layout.rows((4, 4)))
    a = plan.a.shard(np.ones((4, 4), np.float32), RANK)
    with pytest.raises(ValueError, match="sync must be one of"):
        om.matmul(a, jnp.ones((4, 4), jnp.float32), plan, sync="sometimes")


@pytest.mark.ranks(min=3, reason="a replicated C is staged from 3 ranks on")
@pytest.mark.parametrize("side", [64, 900])
def test_a_small_replicated_result_is_summed_directly_a_large_one_staged(side):
    """Small: summed directly (every partial to every rank, one notified round). Large
    (staging saves more than DIRECT_EXTRA_ELEMENTS per rank): reduce-scattered, then
    all-gathered (each rank's block to every other rank, a second notified round). Neither
    fences nor gets."""
    layouts = (om.Layout.cols((side, 3 * SIZE)), om.Layout.rows((3 * SIZE, side)))
    plan = om.plan(*layouts, om.Layout.replicated((side, side)))
    assert plan.gather_stage is not None
    direct = slots.direct_extra_elements(plan) <= slots.DIRECT_EXTRA_ELEMENTS
    assert direct == (side == 64)
    a, b, a_loc, b_loc = _blocks((*layouts, None))
    before = om.stats()
    c = np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(a_loc, b_loc))
    after = om.stats()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    assert len(set(COMM.allgather(c.tobytes()))) == 1
    assert after["fences"] == before["fences"] and after["gets"] == before["gets"]
    sent = after["sent_bytes"] - before["sent_bytes"]
    assert sent == om.rma_bytes(plan, 4, 4, sync="notify")[RANK]


@pytest.mark.ranks(min=3, reason="a replicated C is staged from 3 ranks on")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape", [(2, 2), (5, 7), (40, 2)], ids=["a-rank-owns-nothing", "cols", "rows"]
)
def test_the_notified_all_gather_gives_every_rank_the_same_whole_result(staged, shape, dtype):
    """The all-gather of a staged plan, however C is split (a rank owning no block of the even
    split only receives), in 16-bit too (its blocks travel in float32): every rank holds the
    same bits, without a fence or a get."""
    m, n = shape
    layouts = (om.Layout.cols((m, 3 * SIZE)), om.Layout.rows((3 * SIZE, n)))
    plan = om.plan(*layouts, om.Layout.replicated(shape))
    assert slots.executed_plan(plan, _NOTIFY) is plan.gather_stage
    a, b, a_loc, b_loc = _blocks((*layouts, None))
    a, b = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in (a, b))
    before = om.stats()
    step = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    c = step(a_loc.astype(dtype), b_loc.astype(dtype))
    after = om.stats()
    assert c.dtype == dtype and c.shape == shape
    np.testing.assert_allclose(np.asarray(c, np.float32), a @ b, rtol=1e-2, atol=5e-2)
    assert len(set(COMM.allgather(np.asarray(c).tobytes()))) == 1
    assert after["fences"] == before["fences"] and after["gets"] == before["gets"]


def _fetch_case(c_kind: str):
    """A product whose ranks get pieces of A or B from several others: A by rows, B by
    columns, C by rows (B's pieces fetched, nothing delivered), columns or a grid (the planner
    also computes some of C where the inputs are, and delivers it)."""
    M, K, N = 30, 24, 4 * SIZE + 2
    c = {
        "rows": om.Layout.rows((M, N)),
        "cols": om.Layout.cols((M, N)),
        "grid": om.Layout.grid((M, N), (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)),
    }[c_kind]
    return om.Layout.rows((M, K)), om.Layout.cols((K, N)), c, None


@pytest.mark.ranks(min=2, reason="pieces owned by other ranks")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_notified_fetch_pushes_the_pieces_without_a_fence_or_a_get(dtype, monkeypatch):
    """The owners push the B pieces their getters need: no fence, no get, each rank sends the
    pieces it serves (in the accumulation dtype), and the product is the fenced one bit for bit
    (the pieces arrive unchanged, 16-bit ones through float32; the fetch in place, so that the
    GEMMs are the fenced product's: fetching ahead splits them, tests/mpi/runtime/
    test_fetch_ahead.py)."""
    monkeypatch.setenv("OSMM_FETCH_AHEAD", "0")
    case = _fetch_case("rows")
    plan = _plan(case)
    assert plan.has_gets and not plan.has_deliveries
    a, b, a_loc, b_loc = _blocks(case)
    a_loc, b_loc = (jnp.asarray(x, dtype) for x in (a_loc, b_loc))
    fenced = np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="fence"))(a_loc, b_loc))
    before = om.stats()
    notified = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(a_loc, b_loc)
    notified = np.asarray(notified)
    after = om.stats()
    assert notified.dtype == dtype and notified.tobytes() == fenced.tobytes()
    a, b = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (a, b))
    tolerance = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
        notified.astype(np.float64), plan.c.shard(a @ b, RANK), rtol=tolerance, atol=tolerance
    )
    assert after["fences"] == before["fences"] and after["gets"] == before["gets"]
    acc = np.dtype(dtypes.accumulation_dtype(dtype)).itemsize
    sent = after["sent_bytes"] - before["sent_bytes"]
    assert sent == acc * sum(t.elements for t in plan.for_rank(RANK).served)


@pytest.mark.ranks(min=2, reason="pieces owned by other ranks")
@pytest.mark.parametrize("c_kind", ["cols", "grid"])
def test_a_fetch_before_a_notified_reduce_hears_from_every_rank(c_kind):
    """With partials to deliver after it, the notified fetch has every rank notify the ranks
    that get pieces from it (here every other rank), in each of its rounds (a grid's A
    pieces, then its B pieces), then the reduce its targets; no fence and no get either way."""
    case = _fetch_case(c_kind)
    plan = _plan(case)
    assert plan.has_gets and plan.has_deliveries
    a, b, a_loc, b_loc = _blocks(case)
    before = om.stats()
    c = np.asarray(jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))(a_loc, b_loc))
    after = om.stats()
    np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    assert after["fences"] == before["fences"] and after["gets"] == before["gets"]
    reduce_targets = {t.target for t in plan.deliveries_from(RANK)}
    notified = after["notifications"] - before["notifications"]
    rounds = slots.fetch_rounds(plan, "notify")
    if c_kind == "cols" or SIZE == 2:  # pieces of B only (a 1x2 grid's C: as by columns)
        assert rounds == (("A", "B"),)
    elif SIZE == 4:  # a 2x2 grid: A's pieces, then B's
        assert rounds == (("A",), ("B",))
    served = plan.for_rank(RANK).served
    getters = [{t.origin for t in served if t.matrix in matrices} for matrices in rounds]
    assert set().union(*getters) == set(range(SIZE)) - {RANK}
    assert notified == sum(map(len, getters)) + len(reduce_targets)
    assert (
        after["sent_bytes"] - before["sent_bytes"] == om.rma_bytes(plan, 4, 4, sync="notify")[RANK]
    )


@pytest.mark.ranks(4, reason="a 2x2 grid")
def test_a_grid_product_holds_only_its_fetched_pieces_beside_its_blocks():
    """A 2x2 grid's rank gets one A block and one B block, in two rounds, each in a buffer of
    its own, and multiplies them with its own blocks without joining them into panels, the
    GEMMs on fetched pieces first: XLA's temporaries are the two fetched blocks (joined, the
    panels took four; with the GEMM on the rank's own blocks first, ranks 0 and 3 held three),
    as memory_bytes predicts, and the product is right."""
    n = 256
    layout = om.Layout.grid((n, n), (2, 2))
    plan = om.plan(layout, layout, layout)
    a, b, a_loc, b_loc = _blocks((layout, layout))
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    block_bytes = (n // 2) ** 2 * 4
    c = np.asarray(product(a_loc, b_loc))
    temp = product.lower(a_loc, b_loc).compile().memory_analysis().temp_size_in_bytes
    np.testing.assert_allclose(c, layout.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    predicted = om.memory_bytes(plan, RANK, sync="notify").transient
    if not slots.uses_messages(plan, _resolve_sync("notify")):  # messages: images to send too
        assert predicted == 2 * block_bytes
    assert 2 * block_bytes <= temp <= predicted + 4096


@pytest.mark.ranks(min=2, reason="windows other ranks write into")
@pytest.mark.parametrize("name", ["k_split", "staged", "grid"])
def test_the_windows_hold_in_memory_the_slots_memory_bytes_counts(name, request):
    """Within a node the windows are a shared file whose pages take memory only once written
    (or read): after one product, this rank's window pages in memory are the slots
    memory_bytes counts (``.windows``), not the accumulator a placement never sums into,
    nor the slots of origins it does not have."""
    if name == "staged":  # a reduce-scatter, then the all-gather's placement
        request.getfixturevalue("staged")
    n = 512  # blocks of many pages
    rows, cols = om.Layout.rows((n, n)), om.Layout.cols((n, n))
    layouts = {
        "k_split": (cols, rows, rows),
        "staged": (cols, rows, om.Layout.replicated((n, n))),
        "grid": (om.Layout.grid((n, n), (SIZE // 2, 2) if SIZE % 2 == 0 else (1, SIZE)),) * 3,
    }[name]
    plan = om.plan(*layouts)
    _, _, a_loc, b_loc = _blocks(layouts)
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    product(a_loc, b_loc).block_until_ready()
    jax.effects_barrier()
    om.release()  # the windows the next product creates are fresh
    product(a_loc, b_loc).block_until_ready()
    jax.effects_barrier()
    COMM.Barrier()  # every origin's writes are in
    regions = native.window_regions()
    if not all(COMM.allgather(any(not own for own, _, _ in regions))):
        pytest.skip("the windows are not shared memory under this MPI (nothing to tell apart)")
    resident = sum(pages.resident_bytes(address, nbytes) for own, address, nbytes in regions if own)
    expected = om.memory_bytes(plan, RANK, sync="notify").windows
    # A slot need not begin on a page: its neighbours' edge pages may come in too.
    assert abs(resident - expected) <= 4 * pages.PAGE * (2 + SIZE), (resident, expected)


@pytest.mark.ranks(min=3, reason="several owners per getter")
def test_notified_fetch_through_one_slot_gives_the_same_bits(monkeypatch, credits):
    """A slot budget of one slot: a getter takes its owners' pieces in rounds, one owner at a
    time (in ascending rank order), and the product and its gradients keep their bits."""
    case = _fetch_case("rows")
    plan = _plan(case)
    _, _, a_loc, b_loc = _blocks(case)

    def step(x, y):
        return jax.value_and_grad(
            lambda x, y: jnp.sum(jnp.sin(om.matmul(x, y, plan, sync="notify"))), (0, 1)
        )(x, y)

    unlimited = jax.tree.map(np.asarray, jax.jit(step)(a_loc, b_loc))
    monkeypatch.setenv(config.SLOT_BUDGET, "1")
    rounds = jax.tree.map(np.asarray, jax.jit(step)(a_loc, b_loc))
    for x, y in zip(jax.tree.leaves(unlimited), jax.tree.leaves(rounds)):
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("sync", config.SYNC_MODES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", ["k_split", "data_parallel", "staged", "fetch"])
def test_rma_bytes_predicts_the_bytes_each_mode_moves(name, dtype, sync, monkeypatch):
    """``osmm_jax.rma_bytes`` is what ``stats()["rma_bytes"]`` grows by per product on every
    rank, fenced (the plan's gets and deliveries) and notified (pushed pieces in the
    accumulation dtype, a small replicated C summed directly, a staged one's blocks pushed by
    their owners)."""
    if name == "staged":
        monkeypatch.setattr(slots, "DIRECT_EXTRA_ELEMENTS", 0)
        monkeypatch.setattr(slots, "DIRECT_EXTRA_ELEMENTS_MESSAGES", 0)
    case = _cases()["data_parallel" if name == "staged" else name]
    plan = _plan(case)
    _, _, a_loc, b_loc = _blocks(case)
    a_loc, b_loc = (jnp.asarray(x, dtype) for x in (a_loc, b_loc))
    product = jax.jit(lambda x, y: om.matmul(x, y, plan, sync=sync))
    jax.block_until_ready(product(a_loc, b_loc))  # compiled, windows made
    before = om.stats()["rma_bytes"]
    jax.block_until_ready(product(a_loc, b_loc))
    moved = om.stats()["rma_bytes"] - before
    itemsize = np.dtype(dtype).itemsize
    acc = np.dtype(dtypes.accumulation_dtype(dtype)).itemsize
    assert moved == om.rma_bytes(plan, itemsize, acc, sync=sync)[RANK]
    assert om.rma_bytes(plan, itemsize, acc, sync="fence") == plan.bytes_issued(itemsize, acc)
    default = default_sync().mode  # OSMM_SYNC, else this MPI's default
    assert om.rma_bytes(plan, itemsize, acc) == om.rma_bytes(plan, itemsize, acc, sync=default)


@pytest.mark.ranks(4, reason="a 2 x 2 x 1 split of the work, where ranks exchange no pieces")
@pytest.mark.parametrize("transport", ["rma", "messages"])
def test_a_rank_notifies_only_the_ranks_it_exchanges_with(monkeypatch, transport):
    """A product that fetches pieces and delivers partials (a 3-D split of the work): each
    rank sends one notification per rank that gets pieces from it and one per rank it delivers
    to, not one to every rank, and the result is right."""
    monkeypatch.setenv("OSMM_TRANSPORT", transport)
    m, k, n = 17, 22, 13
    a_l, b_l, c_l, work = om.three_d_layouts((m, k, n), (2, 2, 1))
    plan = om.plan(a_l, b_l, c_l, work=work)
    mine = plan.for_rank(RANK)
    assert plan.has_gets and plan.has_deliveries
    expected = len({t.origin for t in mine.served}) + len({t.target for t in mine.deliveries})
    rng = np.random.default_rng(4)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    fn = jax.jit(lambda x, y: om.matmul(x, y, plan, sync="notify"))
    a_loc, b_loc = plan.a.shard(a, RANK), plan.b.shard(b, RANK)
    np.asarray(fn(a_loc, b_loc))
    before = om.stats()["notifications"]
    c = np.asarray(fn(a_loc, b_loc))
    np.testing.assert_allclose(c, plan.c.shard(a @ b, RANK), rtol=1e-4, atol=1e-4)
    assert om.stats()["notifications"] - before == expected
    assert COMM.allreduce(expected) < 2 * SIZE * (SIZE - 1)  # fewer than every rank to every rank


@pytest.mark.ranks(min=3, reason="a replicated C is staged from 3 ranks on")
def test_a_staged_sum_with_an_empty_contributor_is_right_after_other_products(staged):
    """K split with the last rank holding no columns: a rank then adds nothing to the others'
    rows (on 3 ranks a block has one remote contributor, delivered by put), and such a stage
    is not summed in the GEMM's buffer (summed there it gave wrong sums after other products:
    on 4 ranks in this file, and in the random products, seed 1406902262, case 59). Every
    result, after products of other data and dtypes, is A @ B."""
    M, K, N = 31, 2 * (SIZE - 1), 5
    weights = (1.0,) * (SIZE - 1) + (0.0,)
    plan = om.plan(
        om.Layout.cols((M, K), weights=weights),
        om.Layout.replicated((K, N)),
        om.Layout.replicated((M, N)),
    )
    assert all(one_sided.sums_in_place(plan, r, _NOTIFY, 4) is None for r in range(SIZE))
    rng = np.random.default_rng(11)
    for dtype in (jnp.bfloat16, jnp.float32, jnp.bfloat16):
        a = rng.standard_normal((M, K)).astype(dtype)
        b = rng.standard_normal((K, N)).astype(dtype)
        for chunk_bytes in (24, None):
            c = om.matmul(plan.a.shard(a, RANK), b, plan, sync="notify", chunk_bytes=chunk_bytes)
            exact = a.astype(np.float32) @ b.astype(np.float32)
            np.testing.assert_allclose(np.asarray(c, np.float32), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.ranks(min=3, reason="a replicated C is staged from 3 ranks on")
def test_a_weight_gradient_is_summed_in_its_result_with_the_bits_of_separate_partials(
    staged, monkeypatch
):
    """The data-parallel weight gradient (dB = A.T @ dC, each rank's partial one GEMM over the
    whole replicated dB) is reduce-scattered and gathered in the GEMM's own buffer: the bits
    of the path that sends its partials from buffers of their own, on every rank, whatever
    the chunk size (one GEMM either way); XLA holds no partial beside the gradient, only the
    copy of the rank's rows it sends, as memory_bytes counts."""
    M, K, N = 45, 96, 38
    plan = om.plan(om.Layout.rows((M, K)), om.Layout.replicated((K, N)), om.Layout.rows((M, N)))
    d_b_plan = plan.backward()[1]
    assert one_sided.sums_in_place(d_b_plan, RANK, _NOTIFY, 4) is not None
    rng = np.random.default_rng(5)
    a, b, d_c = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (K, N), (M, N)))
    args = (plan.a.shard(a, RANK), b, plan.c.shard(d_c, RANK))

    def run(chunk_bytes=None):
        def product(x, y):
            return om.matmul(x, y, plan, sync="notify", chunk_bytes=chunk_bytes)

        gradient = jax.jit(lambda x, y, d: jax.vjp(product, x, y)[1](d))
        temp = gradient.lower(*args).compile().memory_analysis().temp_size_in_bytes
        return [np.asarray(g) for g in gradient(*args)], temp

    (d_a, d_b), temp = run()
    assert run(chunk_bytes=256)[0][1].tobytes() == d_b.tobytes()
    real = one_sided._summed_in_place
    # Ranks decide alone: rank 0 sends from partials of their own while the others do not.
    # (A new chunk size: a rank's decision is the same on every call of one reduce, so the
    # ranks agree on its signature the first time; a single chunk, so the same bits.)
    monkeypatch.setattr(one_sided, "_summed_in_place", lambda *args: real(*args) if RANK else None)
    assert run(chunk_bytes=1 << 30)[0][1].tobytes() == d_b.tobytes()
    monkeypatch.setattr(one_sided, "_summed_in_place", lambda *args: None)
    (d_a_apart, d_b_apart), temp_apart = run()
    assert d_b.tobytes() == d_b_apart.tobytes() and d_a.tobytes() == d_a_apart.tobytes()
    assert len(set(COMM.allgather(d_b.tobytes()))) == 1
    np.testing.assert_allclose(d_b, a.T @ d_c, rtol=2e-5, atol=2e-4)
    whole = K * N * 4
    own_rows = int(np.prod(d_b_plan.gather_stage.c.local_shape(RANK))) * 4
    assert temp_apart >= whole > temp >= own_rows
    peak = om.memory_bytes(plan, RANK, direction="backward", sync="notify")
    if not slots.uses_messages(d_b_plan, _resolve_sync("notify")):  # no images staged to send
        assert peak.transient == own_rows
