"""Per-rank tallies of a plan's records."""

from __future__ import annotations

from osmm_jax._src.planning.records import LocalMultiply, Transfer
from osmm_jax._src.planning.totals import per_rank_totals


def test_per_rank_totals_buckets_by_the_chosen_rank():
    transfers = [
        Transfer("get", "A", 0, 1, (0, 2), (0, 3)),  # 6 elements from rank 1's memory to rank 0
        Transfer("accumulate", "C", 1, 2, (0, 1), (0, 4), ((0, 1),)),  # 4 from 1 to 2
        Transfer("put", "C", 2, 0, (0, 1), (0, 1), ((0, 1),)),  # 1 from 2 to 0
    ]
    assert per_rank_totals(transfers, 3, "sender", "elements") == (0, 10, 1)
    assert per_rank_totals(transfers, 3, "origin", "elements") == (6, 4, 1)
    assert per_rank_totals(transfers, 3, "receiver", "elements") == (7, 0, 4)
    assert per_rank_totals(transfers, 3, "sender", lambda t: t.nbytes(2, 4)) == (0, 12 + 16, 4)
    assert per_rank_totals(transfers, 3, ("sender", "receiver"), "elements") == (
        (0, 0, 0),
        (6, 0, 4),
        (1, 0, 0),
    )
    multiplies = [LocalMultiply(1, (0, 2), (0, 3), (0, 4), 1, 1, True)]
    assert per_rank_totals(multiplies, 2, "rank", "flops") == (0, 48)
    assert per_rank_totals([], 2, "rank", "flops") == (0, 0)
