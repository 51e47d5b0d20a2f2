"""A plan in words."""

from __future__ import annotations

from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import make_plan


def test_describe_names_ranks_multiplies_and_transfers():
    plan = make_plan(
        Layout.cols((8, 8), nranks=2), Layout.rows((8, 8), nranks=2), Layout.rows((8, 8), nranks=2)
    )
    text = plan.describe()
    assert "over 2 ranks" in text and "rank 0:" in text and "rank 1:" in text
    assert "put C[4:8, 0:8] into rank 1" in text
