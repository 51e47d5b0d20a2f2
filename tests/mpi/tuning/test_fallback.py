"""MethodSelector on real ranks, timing real products: it falls back under a forced slowdown only."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.tuning.fallback import MethodSelector

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# Nothing checked here changes from three ranks to four (uneven splits and a rank with nothing
# appear from 3 on); the 4-rank run is for the 2x2 grids, the notified reduce's origin rounds and
# the tensor-parallel replica groups.
pytestmark = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it")


def _steps(slowed_method: str, delay: float = 0.05):
    plan = om.plan(om.Layout.cols((64, 64)), om.Layout.rows((64, 64)), om.Layout.rows((64, 64)))
    a = jnp.ones(plan.a.local_shape(RANK), jnp.float32)
    b = jnp.ones(plan.b.local_shape(RANK), jnp.float32)
    fns = {
        m: jax.jit(lambda x, y, m=m: om.matmul(x, y, plan, method=m))
        for m in ("one_sided", "allreduce")
    }
    for fn in fns.values():
        fn(a, b).block_until_ready()

    def step(method):
        start = time.perf_counter()
        fns[method](a, b).block_until_ready()
        if method == slowed_method and RANK == SIZE - 1:
            time.sleep(delay)  # a forced slowdown of one method on one rank
        return time.perf_counter() - start

    return step


@pytest.mark.parametrize("slowed_method, falls_back", [("one_sided", True), ("allreduce", False)])
def test_fallback_follows_measured_times(monkeypatch, slowed_method, falls_back):
    monkeypatch.delenv("OSMM_USE_ALLREDUCE", raising=False)
    step = _steps(slowed_method)
    selector = MethodSelector(window=3, ratio=1.2)
    methods = []
    for _ in range(10):
        methods.append(selector.method)
        selector.observe(step(selector.method))
    assert methods[:6] == ["one_sided", "allreduce"] * 3
    assert selector.fallbacks == int(falls_back)
    assert selector.method == ("allreduce" if falls_back else "one_sided")
    # Every rank decided alike.
    assert len(set(MPI.COMM_WORLD.allgather(selector.method))) == 1
