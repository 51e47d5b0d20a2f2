"""auto_layouts, without MPI or JAX: every candidate is a valid plan, the model's choices, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from osmm_jax._src.planning import comm_bound, memory, totals
from osmm_jax._src.planning import plan as plan_module
from osmm_jax._src.planning.auto_layout import (
    DEFAULT_BANDWIDTH,
    THREE_D_CANDIDATES,
    LayoutChoice,
    _three_d_grids,
    auto_layouts,
    candidate_layouts,
    predict,
)
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan, make_plan
from osmm_jax._src.planning.plan_totals import PlanTotals
from osmm_jax._src.planning.work import three_d_layouts

SPEEDS = [3.0, 1.0, 2.0, 2.0, 0.5, 4.0]


def _primary_flops(plan: Plan) -> int:
    return sum(m.flops for m in plan.multiplies if m.primary)


def _heights(layout: Layout) -> list[int]:
    return [r1 - r0 for (r0, r1), _ in layout.blocks]


@pytest.mark.parametrize("nranks", range(1, 7))
@pytest.mark.parametrize("replicated_is_free", [True, False])
def test_every_candidate_plans_the_whole_product(nranks, replicated_is_free):
    M, K, N = 13, 11, 7
    speeds = SPEEDS[:nranks]
    names = []
    for name, a, b, c, work in candidate_layouts(
        M, K, N, speeds, replicated_is_free=replicated_is_free
    ):
        names.append(name)
        plan = Plan(a, b, c, work=work)
        assert plan.nranks == nranks
        assert _primary_flops(plan) == 2 * M * K * N, name
        assert (work is None) == (not name.startswith("3-D")), name
    grids = [f"grid {pr}x{nranks // pr}" for pr in range(2, nranks) if nranks % pr == 0]
    three_d = [f"3-D {pm}x{pk}x{pn}" for pm, pk, pn in _three_d_grids(M, K, N, nranks)]
    assert names == ["rows", "cols", "k_split", *grids, *three_d]
    assert len(three_d) == min(THREE_D_CANDIDATES, {4: 2, 6: 4}.get(nranks, 0))

    choice = auto_layouts(M, K, N, speeds, replicated_is_free=replicated_is_free)
    assert isinstance(choice, LayoutChoice)
    assert [c.name for c in choice.candidates] == names
    assert choice.name in names
    assert (
        _primary_flops(make_plan(choice.a, choice.b, choice.c, work=choice.work)) == 2 * M * K * N
    )
    assert choice.predicted_seconds <= min(c.predicted_seconds for c in choice.candidates) * (
        1 + 1e-3
    )
    for cand in choice.candidates:
        assert cand.predicted_seconds == cand.compute_seconds + cand.comm_seconds


def test_grids_for_six_ranks():
    names = [n for n, *_ in candidate_layouts(12, 12, 12, [1] * 6, replication="free")]
    assert names[:5] == ["rows", "cols", "k_split", "grid 2x3", "grid 3x2"]
    assert names[5:] == ["3-D 1x2x3", "3-D 1x3x2", "3-D 2x3x1"]
    # Replicas kept in sync: the same strategies with the operand left split compete too.
    names = [n for n, *_ in candidate_layouts(12, 12, 12, [1] * 6)]
    assert names == [
        "rows",
        "cols",
        "rows, B split",
        "cols, A split",
        "k_split",
        "grid 2x3",
        "grid 3x2",
        "3-D 1x2x3",
        "3-D 1x3x2",
        "3-D 2x3x1",
    ]


def test_rows_wins_without_communication_when_b_is_small():
    # Tall A, small B: rows splits M finely; cols cannot balance 8 columns over speeds 1:2:3.
    assert auto_layouts(6000, 64, 8, [1.0, 2.0, 3.0]).name == "rows"  # B synced: 2 KiB
    choice = auto_layouts(6000, 64, 8, [1.0, 2.0, 3.0], replication="free")
    assert choice.name == "rows"
    best = choice.candidates[0]
    assert best.comm_seconds == 0
    assert choice.predicted_seconds < choice.candidates[1].predicted_seconds
    assert "no communication" in choice.reason
    assert "assumed already on every rank" in choice.reason
    assert "Runner-up" in choice.reason
    assert choice.a.kind == "rows" and choice.b.is_replicated and choice.c.kind == "rows"
    assert _heights(choice.a) == [1000, 2000, 3000]
    # Fetching the small B costs little, so rows wins even when it must be fetched.
    assert auto_layouts(6000, 64, 8, [1.0, 2.0, 3.0], replicated_is_free=False).name == "rows"


def test_ties_go_to_the_fewest_bytes_then_the_first_candidate():
    choice = auto_layouts(64, 64, 64, [1.0] * 4, replication="free")
    rows, cols = choice.candidates[:2]
    assert rows.predicted_seconds == cols.predicted_seconds
    assert choice.name == "rows" and "a tie" in choice.reason
    # Shares rounded to whole rows make cols 0.02% faster here: still a tie.
    choice = auto_layouts(2048, 2048, 5504, [41.0, 41.0, 85.0], replication="free")
    rows, cols = choice.candidates[:2]
    assert cols.predicted_seconds < rows.predicted_seconds < cols.predicted_seconds * 1.001
    assert choice.name == "rows" and "a tie" in choice.reason


def test_cols_wins_when_there_are_too_few_rows():
    # Two rows over four ranks: rows leaves two ranks idle; cols splits N.
    choice = auto_layouts(2, 64, 4096, [1.0] * 4)
    assert choice.name == "cols"
    assert choice.a.is_replicated and choice.b.kind == "cols"


def test_k_split_wins_when_k_is_the_only_large_dimension():
    choice = auto_layouts(2, 1 << 20, 2, [1.0] * 4)
    assert choice.name == "k_split"
    assert choice.a.kind == "cols" and choice.b.kind == "rows"


def test_the_k_much_larger_than_m_numbers_in_the_docstring():
    def table(M, K, N, free):
        choice = auto_layouts(M, K, N, [100.0] * 4, replicated_is_free=free)
        # The four strategies of the docstring's table (the 3-D splits are slower here).
        times = {c.name: round(c.predicted_seconds, 4) for c in choice.candidates}
        assert all(t > times[choice.name] for n, t in times.items() if n.startswith("3-D"))
        return choice.name, {n: t for n, t in times.items() if not n.startswith("3-D")}

    name, times = table(256, 16384, 4096, True)
    assert name == "rows"
    assert times == {"rows": 0.0859, "cols": 0.0859, "k_split": 0.0865, "grid 2x2": 0.0878}
    name, times = table(256, 16384, 4096, False)
    assert name == "k_split"
    assert times == {"rows": 0.0872, "cols": 0.0884, "k_split": 0.0865, "grid 2x2": 0.0878}
    name, times = table(256, 4096, 16384, False)
    assert name == "cols"
    assert times["cols"] == 0.0865 and times["k_split"] == 0.0884


def test_heterogeneous_speeds_shift_the_shares():
    speeds = [1.0, 3.0]
    choice = auto_layouts(4000, 256, 256, speeds, replication="free")
    assert choice.name == "rows"
    assert _heights(choice.a) == [1000, 3000]
    plan = Plan(choice.a, choice.b, choice.c)
    times = [f / (s * 1e9) for f, s in zip(plan.flops, speeds)]
    assert times[0] == pytest.approx(times[1])
    assert choice.predicted_seconds == pytest.approx(max(times))


def test_replicated_operands_are_priced_by_default():
    # The GPT-3 FFN weight, 12288 x 49152 float32 (2.25 GiB), on 8 equal ranks. Free, it ties
    # with every strategy of the same flops and rows wins; kept in sync, rows pays a third of
    # 2 * 7/8 of it per product (one all-reduce of its gradient per training step of 3 products),
    # it per product and a layout that moves less wins.
    M, K, N, speeds = 8192, 12288, 49152, [100.0] * 8
    free = auto_layouts(M, K, N, speeds, replication="free", memory_budget=math.inf)
    assert free.name == "rows"
    synced = auto_layouts(M, K, N, speeds, memory_budget=math.inf)
    by_name = {c.name: c for c in synced.candidates}
    assert by_name["rows"].sync_bytes == 2 * 7 * K * N * 4 // (8 * 3)
    assert by_name["k_split"].sync_bytes == 0
    assert synced.name != "rows"
    assert "keeping the copies of" in synced.reason  # the runner-up's, here cols (A)
    assert by_name[synced.name].comm_seconds < by_name["rows"].comm_seconds
    assert by_name["rows"].memory_bytes >= K * N * 4


def test_the_memory_budget_leaves_out_layouts_that_do_not_fit(monkeypatch):
    from osmm_jax._src import config

    for name in (config.SYNC, config.SLOT_BUDGET):  # the notified mode, 512 MiB of slots
        monkeypatch.delenv(name, raising=False)
    M, K, N, speeds = 8192, 12288, 49152, [100.0] * 8
    free = auto_layouts(M, K, N, speeds, replication="free", memory_budget=math.inf)
    assert free.name == "rows"
    # Per rank: rows holds B whole (2.25 GiB); a K-split holds little of each matrix but
    # computes a partial of all of C, 7/8 of which it keeps until delivered, and its window
    # holds an accumulator and the two 192 MiB slots (C blocks) the 512 MiB slot budget allows;
    # cols holds A whole (384 MiB) and its shares of B and C (480 MiB), with nothing to fetch
    # or deliver (no slots either).
    budget = 900 * 2**20
    tight = auto_layouts(M, K, N, speeds, replication="free", memory_budget=budget)
    by_name = {c.name: c for c in tight.candidates}
    owned = (M * K // 8 + K * N // 8 + M * N // 8) * 4
    slots = (1 + 2) * (M * N // 8 * 4)
    assert by_name["k_split"].memory_bytes == owned + 7 * M * N // 8 * 4 + slots
    assert by_name["cols"].memory_bytes == (M * K + (K * N + M * N) // 8) * 4
    assert not by_name["rows"].fits and not by_name["k_split"].fits and by_name["cols"].fits
    assert tight.name not in ("rows", "k_split") and by_name[tight.name].fits
    assert by_name[tight.name].memory_bytes <= budget
    assert "Over the memory budget of 900 MiB per rank: " in tight.reason
    assert "rows" in tight.reason.split("Over the memory budget")[1]
    with pytest.raises(
        ValueError,
        match=r"fits the memory budgets, even .* on rank 0 at shares by speed, "
        r"which has 1 MiB",
    ):
        auto_layouts(M, K, N, speeds, memory_budget=2**20)


def test_the_slots_count_only_in_the_notified_mode_and_within_their_budget(monkeypatch):
    from osmm_jax._src import config

    M, K, N, speeds = 4096, 4096, 4096, [1.0] * 4
    block = M * N // 4 * 4  # the largest C block of the K-split, float32

    def k_split_memory():
        choice = auto_layouts(M, K, N, speeds, replication="free", memory_budget=math.inf)
        return {c.name: c for c in choice.candidates}["k_split"].memory_bytes

    monkeypatch.setenv(config.SYNC, "fence")
    fence = k_split_memory()
    monkeypatch.setenv(config.SYNC, "notify")
    monkeypatch.setenv(config.SLOT_BUDGET, "none")
    assert k_split_memory() == fence + (1 + 3) * block  # a slot for each of 3 origins
    monkeypatch.setenv(config.SLOT_BUDGET, "1")
    assert k_split_memory() == fence + (1 + 1) * block  # never fewer than one slot


def test_the_notified_fetch_counts_its_slots(monkeypatch):
    """On a 2 x 2 grid each rank fetches the halves of its A rows and B columns that its grid
    neighbours hold (2 x 2048 x 2048 elements) and delivers nothing: in the notified mode its
    window holds an accumulator and a slot of that size per owner it could get from."""
    from osmm_jax._src import config

    M = K = N = 4096
    fetched = 2 * 2048 * 2048 * 4  # float32 bytes

    def grid_memory():
        choice = auto_layouts(M, K, N, [1.0] * 4, replication="free", memory_budget=math.inf)
        return {c.name: c for c in choice.candidates}["grid 2x2"].memory_bytes

    monkeypatch.setenv(config.SYNC, "fence")
    fence = grid_memory()
    monkeypatch.setenv(config.SYNC, "notify")
    monkeypatch.setenv(config.SLOT_BUDGET, "none")
    assert grid_memory() == fence + (1 + 3) * fetched
    monkeypatch.setenv(config.SLOT_BUDGET, "1")
    assert grid_memory() == fence + (1 + 1) * fetched


def test_the_memory_budget_defaults_to_the_environment_or_a_share_of_the_host(monkeypatch):
    from osmm_jax._src import config

    monkeypatch.setenv(config.MEMORY_BUDGET, "1GiB")
    assert config.memory_budget() == 2**30
    by_name = {c.name: c for c in auto_layouts(8192, 12288, 49152, [1.0] * 8).candidates}
    assert not by_name["rows"].fits
    for text, value in (
        ("512 MiB", 2**29),
        ("1.5e9", 1.5e9),
        ("none", math.inf),
        ("0", math.inf),
        ("0 B", math.inf),
    ):
        monkeypatch.setenv(config.MEMORY_BUDGET, text)
        assert config.memory_budget() == value
    for bad in ("lots", "-1GiB", "3 parsecs"):
        monkeypatch.setenv(config.MEMORY_BUDGET, bad)
        with pytest.raises(ValueError, match="OSMM_MEMORY_BUDGET"):
            auto_layouts(64, 64, 64, [1.0])
    monkeypatch.delenv(config.MEMORY_BUDGET)
    assert 0 < config.memory_budget() < math.inf


def test_replication_arguments():
    assert (
        auto_layouts(64, 64, 64, [1.0] * 2, replicated_is_free=False).candidates[0].sync_bytes == 0
    )
    with pytest.raises(ValueError, match="replication must be one of"):
        auto_layouts(64, 64, 64, [1.0], replication="cached")
    with pytest.raises(ValueError, match="contradicts"):
        auto_layouts(64, 64, 64, [1.0], replication="synced", replicated_is_free=True)
    with pytest.raises(ValueError, match="memory_budget"):
        auto_layouts(64, 64, 64, [1.0], memory_budget=0)


def test_the_choice_reports_its_distance_from_the_lower_bound():
    # K-split moves exactly the bound on a K-large product; a 2-D grid on a square one at
    # P = 4 moves 1.13 times it (SUMMA's volume).
    k_large = auto_layouts(2048, 65536, 2048, [1.0] * 4, memory_budget=math.inf)
    assert k_large.name == "k_split"
    assert k_large.bound_ratio == pytest.approx(1.0, rel=1e-6)
    square = auto_layouts(
        8192, 8192, 8192, [1.0] * 4, replication="fetched", memory_budget=math.inf
    )
    assert square.name == "grid 2x2"
    assert square.bound_ratio == pytest.approx(1.13, abs=0.01)


def test_a_rank_is_priced_by_the_busier_direction_of_its_link():
    # A K-split over unequal speeds: the fast ranks own more C rows, so more partials arrive
    # at them than they send; the model prices each rank by the larger of the two.
    M, K, N = 2048, 12288, 3072
    speeds = [1.0, 1.0, 2.0, 2.0] * 2
    choice = auto_layouts(M, K, N, speeds, memory_budget=math.inf)
    by_name = {c.name: c for c in choice.candidates}
    layouts = {n: (a, b, c) for n, a, b, c, _ in candidate_layouts(M, K, N, speeds)}
    for name in ("k_split", "grid 4x2", "rows, B split"):
        plan, cand = Plan(*layouts[name]), by_name[name]
        sent = plan.bytes_sent()
        received = totals.per_rank_totals(plan.transfers, plan.nranks, "receiver", "elements")
        received = tuple(4 * r for r in received)  # float32 pieces and partials
        link = max(max(s, r) for s, r in zip(sent, received))
        assert cand.sent_bytes == max(sent), name
        assert cand.link_bytes == link, name
        assert cand.link_elements == link // 4, name
        assert cand.comm_seconds == pytest.approx((link + cand.sync_bytes) / DEFAULT_BANDWIDTH)
        assert cand.moved_elements == max(comm_bound.moved_elements(plan)), name
        assert predict(plan, speeds).comm_seconds == pytest.approx(link / DEFAULT_BANDWIDTH)
    assert by_name["k_split"].link_bytes > by_name["k_split"].sent_bytes


def test_the_bound_ratio_is_the_benchmarks_measure():
    # The most elements one rank gets and delivers (the bound's terms), sync included.
    M, K, N = 2048, 12288, 3072
    for speeds, replication in (([1.0, 1.0, 2.0, 2.0] * 2, "synced"), ([1.0] * 6, "fetched")):
        choice = auto_layouts(M, K, N, speeds, replication=replication, memory_budget=math.inf)
        best = next(c for c in choice.candidates if c.name == choice.name)
        plan = Plan(choice.a, choice.b, choice.c, work=choice.work)
        moved = max(comm_bound.moved_elements(plan)) + best.sync_bytes / 4
        bound = max(comm_bound.rank_bounds(M, K, N, speeds))
        assert choice.bound_ratio == pytest.approx(moved / bound, rel=1e-12)


def test_grid_weights_are_the_speed_sums_of_grid_rows_and_columns():
    # Grid row 1 is twice as fast: the speeds are an outer product, so areas match exactly.
    layouts = {n: (a, b, c) for n, a, b, c, _ in candidate_layouts(60, 60, 60, [1, 1, 2, 2])}
    _, _, c = layouts["grid 2x2"]
    areas = [(r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in c.blocks]
    assert areas == [600, 600, 1200, 1200]


def test_a_rank_with_speed_zero_gets_no_work():
    choice = auto_layouts(900, 64, 64, [1.0, 0.0, 2.0])
    plan = Plan(choice.a, choice.b, choice.c)
    assert plan.flops[1] == 0
    assert math.isfinite(choice.predicted_seconds)
    busy = Plan(
        Layout.rows((4, 4), nranks=2), Layout.replicated((4, 4), 2), Layout.rows((4, 4), nranks=2)
    )
    assert predict(busy, [1.0, 0.0]).predicted_seconds == math.inf


def test_bandwidth_and_itemsize_scale_communication():
    base = {c.name: c for c in auto_layouts(512, 4096, 512, [1.0] * 2).candidates}
    slow = {c.name: c for c in auto_layouts(512, 4096, 512, [1.0] * 2, bandwidth=1e9).candidates}
    assert slow["k_split"].comm_seconds == pytest.approx(
        base["k_split"].comm_seconds * DEFAULT_BANDWIDTH / 1e9
    )
    f64 = {c.name: c for c in auto_layouts(512, 4096, 512, [1.0] * 2, itemsize=8).candidates}
    bf16 = {c.name: c for c in auto_layouts(512, 4096, 512, [1.0] * 2, itemsize=2).candidates}
    assert f64["k_split"].comm_seconds == pytest.approx(2 * base["k_split"].comm_seconds)
    # Partials travel in float32 for 16-bit inputs.
    assert bf16["k_split"].comm_seconds == base["k_split"].comm_seconds


def test_one_rank():
    choice = auto_layouts(8, 8, 8, [5.0])
    assert choice.name == "rows"
    assert choice.predicted_seconds == pytest.approx(2 * 8**3 / 5e9)
    assert all(c.comm_seconds == 0 for c in choice.candidates)


def test_deterministic():
    first = auto_layouts(300, 200, 100, [1.5, 2.5, 1.0, 3.0])
    assert auto_layouts(300, 200, 100, [1.5, 2.5, 1.0, 3.0]) == first


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 4, 4, [1.0]), {}, ValueError, "M must be positive"),
        ((4, -1, 4, [1.0]), {}, ValueError, "K must be"),
        ((4, 4, 2.5, [1.0]), {}, TypeError, "N must be an integer"),
        ((4, 4, 4, []), {}, ValueError, "speeds is empty"),
        ((4, 4, 4, [1.0, math.nan]), {}, ValueError, "finite"),
        ((4, 4, 4, [math.inf]), {}, ValueError, "finite"),
        ((4, 4, 4, [1.0, -1.0]), {}, ValueError, "non-negative"),
        ((4, 4, 4, [0, 0]), {}, ValueError, "all zero"),
        ((4, 4, 4, ["fast"]), {}, TypeError, "speeds"),
        ((4, 4, 4, [1.0]), {"bandwidth": 0}, ValueError, "bandwidth"),
        ((4, 4, 4, [1.0]), {"bandwidth": -5e9}, ValueError, "bandwidth"),
        ((4, 4, 4, [1.0]), {"bandwidth": math.nan}, ValueError, "bandwidth"),
        ((4, 4, 4, [1.0]), {"itemsize": 0}, ValueError, "itemsize"),
    ],
)
def test_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        auto_layouts(*args, **kwargs)


def test_plan_describe_says_why_auto_layouts_chose_the_layouts():
    choice = auto_layouts(512, 256, 256, [41.0, 41.0, 85.0])
    why = f"chosen by auto_layouts: {choice.reason}"
    assert choice.a.reason == choice.b.reason == choice.c.reason == why
    plain = tuple(dataclasses.replace(x, reason="") for x in (choice.a, choice.b, choice.c))
    assert plain == (choice.a, choice.b, choice.c)  # the reason is not part of equality
    # The reason travels with the layouts, not in a table: equal layouts built by hand plan
    # the same product but say nothing, even when planned first and cached.
    assert why not in make_plan(*plain).describe()
    assert why in make_plan(choice.a, choice.b, choice.c).describe()
    assert why in Plan(choice.a, choice.b, choice.c).describe()
    assert make_plan(*plain) == make_plan(choice.a, choice.b, choice.c)
    # Layouts mixed from different choices (or transposed) were not chosen together.
    assert "chosen by" not in Plan(choice.a, choice.b, plain[2]).describe()
    d_a, d_b = make_plan(choice.a, choice.b, choice.c).backward()
    assert "chosen by" not in d_a.describe() and "chosen by" not in d_b.describe()
    assert not hasattr(plan_module, "_CHOICE_REASONS")


def test_memory_counts_the_pieces_a_rank_fetches_and_the_partials_it_delivers():
    # Square, 64 equal ranks: each owns 3/64 N^2. A 3-D rank at 4 x 4 x 4 also fetches 3/4 of
    # its box's A and B pieces and delivers 3/4 of its box's C: 4 times what it owns. A rank of
    # an 8 x 8 grid fetches 7/8 of its row band of A and of its column band of B: 17/3 times.
    n = 1024
    owned = 3 * n * n // 64 * 4
    a, b, c, work = three_d_layouts((n, n, n), (4, 4, 4))
    box = PlanTotals(a, b, c, work)
    slots = memory.slots_bytes(c, box, 4)
    assert set(memory.memory_per_rank((a, b, c), box, 4, 4)) == {4 * owned + slots}
    grid = [Layout.grid((n, n), (8, 8)) for _ in range(3)]
    held = memory.memory_per_rank(grid, PlanTotals(*grid), 4, 4)
    assert {3 * (h - memory.slots_bytes(grid[2], PlanTotals(*grid), 4)) for h in held} == {
        17 * owned
    }


def test_per_rank_budgets_hold_a_rank_below_its_speed_share(monkeypatch):
    from osmm_jax._src import config

    monkeypatch.delenv(config.SYNC, raising=False)
    M, K, N, speeds = 8192, 4096, 4096, [1.0, 1.0, 2.0]
    mib = 2**20
    free = auto_layouts(M, K, N, speeds, replication="free", memory_budget=math.inf)
    assert free.name == "rows" and free.candidates[0].memory_per_rank == (
        128 * mib,
        128 * mib,
        192 * mib,
    )
    # Rank 2 has room for 120 MiB: B whole (64 MiB) and 56 MiB of A and C rows, not its
    # speed share (half the rows, 128 MiB). It keeps what fits; ranks 0 and 1 share the rest.
    tight = auto_layouts(
        M, K, N, speeds, replication="free", memory_budget=[math.inf, math.inf, 120 * mib]
    )
    rows = tight.candidates[0]
    assert tight.name == "rows" and rows.fits and rows.held_back == (2,)
    assert rows.memory_per_rank[2] <= 120 * mib and rows.memory_per_rank[2] > 119 * mib
    sizes = [r1 - r0 for (r0, r1), _ in tight.a.blocks]
    assert sizes[0] == sizes[1] and sum(sizes) == M
    assert "Shares held below speed by memory: ranks [2]" in tight.reason
    assert "Over the memory budget of no limit, no limit, 120 MiB (by rank): cols" in tight.reason
    assert rows.compute_seconds > free.candidates[0].compute_seconds
    # Every figure is the plan's: the layouts chosen hold what the candidate says.
    held = memory.memory_per_rank(
        (tight.a, tight.b, tight.c), PlanTotals(tight.a, tight.b, tight.c), 4, 4
    )
    assert held == rows.memory_per_rank


def test_a_budget_no_layout_fits_names_the_rank_its_need_and_what_it_has():
    with pytest.raises(ValueError) as error:
        auto_layouts(
            8192,
            4096,
            4096,
            [1.0, 1.0, 2.0],
            replication="free",
            memory_budget=[2**40, 2**40, 60 * 2**20],
        )
    assert str(error.value).startswith(
        "no layout for 8192 x 4096 @ 4096 x 4096 on 3 ranks fits the memory budgets, even with "
        "work moved off the ranks short of memory: the closest, rows, needs 192 MiB on rank 2 "
        "at shares by speed, which has 60 MiB"
    )
