"""PlanTotals: a plan's flops and bytes without its records, equal to the plan's own."""

from __future__ import annotations

from hypothesis import given, settings
from strategies import products

from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.planning.plan_totals import PlanTotals
from osmm_jax._src.planning.totals import per_rank_totals, transfer_bytes


@settings(max_examples=300, deadline=None)
@given(products(max_ranks=6))
def test_plan_totals_are_the_plans_own(layouts):
    plan, totals = Plan(*layouts), PlanTotals(*layouts)
    assert totals.nranks == plan.nranks
    assert totals.flops == plan.flops
    for sizes in ((4, 4), (2, 4), (8, 8), (1, 3)):
        assert totals.bytes_sent(*sizes) == plan.bytes_sent(*sizes)
        assert totals.bytes_issued(*sizes) == plan.bytes_issued(*sizes)
        # What arrives at each rank: its gets (and a staged plan's gathers) and the partials
        # delivered into its block, counted from the plan's own transfers.
        received = per_rank_totals(plan.transfers, plan.nranks, "receiver", transfer_bytes(*sizes))
        assert totals.bytes_received(*sizes) == received
