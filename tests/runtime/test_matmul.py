"""osmm_jax.memory_bytes (osmm_jax._src.runtime.matmul), without MPI traffic."""

from __future__ import annotations

import pytest

import osmm_jax as om
from osmm_jax._src.planning import memory
from osmm_jax._src.planning.layout import Layout
from osmm_jax._src.planning.plan import Plan
from osmm_jax._src.runtime import slots


def _grid(n=8):
    return Plan(*(Layout.grid((n, n), (2, 2)) for _ in range(3)))


@pytest.mark.parametrize("rank", range(4))
def test_a_forward_peak_is_the_blocks_the_product_s_buffers_and_the_slots(rank):
    plan = _grid()
    peak = om.memory_bytes(plan, rank, sync="notify")
    assert peak.blocks == 3 * 16 * 4  # A, B and C blocks of 4x4 float32
    assert peak.transient == memory.one_sided_transient(plan, rank, packed=True) * 4 == 256
    assert peak.windows == slots.resident_window_bytes(plan, rank, 4, 4, slots.Sync("notify"))
    assert peak.total == peak.blocks + peak.transient + peak.windows


def test_a_gradient_peak_holds_both_backward_products_or_the_forward_with_their_packing():
    plan = _grid()
    d_a, d_b = plan.backward()
    for rank in range(4):
        peak = om.memory_bytes(plan, rank, direction="backward", sync="notify")
        assert peak.blocks == (2 * (16 + 16) + 16) * 4  # A, B, their gradients, C's cotangent
        both = sum(memory.one_sided_transient(p, rank, packed=True) for p in (d_a, d_b))
        packed = sum(t.elements for p in (d_a, d_b) for t in p.for_rank(rank).served)
        early = memory.one_sided_transient(plan, rank, packed=True) + packed
        assert peak.transient == max(both, early) * 4


def test_the_allreduce_method_holds_no_windows_and_its_products_in_turn():
    plan = _grid()
    forward = om.memory_bytes(plan, 0, method="allreduce")
    assert (forward.transient, forward.windows) == (memory.allreduce_transient(plan) * 4, 0)
    backward = om.memory_bytes(plan, 0, method="allreduce", direction="backward")
    d_a, d_b = plan.backward()
    both = memory.allreduce_transient(d_a) + memory.allreduce_transient(d_b)
    assert backward.transient == max(memory.allreduce_transient(plan), both) * 4


def test_16_bit_inputs_count_their_blocks_in_two_bytes_and_the_buffers_in_four():
    plan = _grid()
    peak = om.memory_bytes(plan, 0, 2, 4, sync="notify")
    assert peak.blocks == 3 * 16 * 2
    assert peak.transient == om.memory_bytes(plan, 0, 4, 4, sync="notify").transient


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"direction": "sideways"}, "direction"),
        ({"rank": 4}, "rank"),
        ({"rank": -1}, "rank"),
        ({"method": "carrier pigeon"}, "method"),
        ({"input_itemsize": 0}, "input_itemsize"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = {"rank": 0, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        om.memory_bytes(_grid(), **args)
