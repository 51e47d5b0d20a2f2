"""A job whose ranks fall out of step, for the watchdog tests (tests/runtime/test_watchdog.py).

    mpiexec -n 3 python tests/failure_programs/out_of_step.py SCENARIO

SCENARIO:
    extra          every rank runs the same jitted products, then rank 0 runs one more
                   (the others go on to the end of the program and its teardown);
    swapped        two plans are run once in the same order everywhere, then rank 0 runs
                   them in one order and the other ranks in the other;
    swapped_first  the same without the first, common run (the ranks meet each plan's call
                   for the first time out of step);
    swapped_same   like swapped, with two plans that use the same windows in the same way
                   (each a single reduce epoch), so that the fences match and only the call
                   ids tell the ranks apart;
    extra_allreduce  like extra, with method="allreduce" (rank 0 waits in mpi4jax's
                   all-reduce, which osmm_jax brackets for the watchdog);
    raise          like extra, but rank 0 runs its extra product under
                   ``osmm_jax.timeout(3, "raise")``: it catches the error, prints it
                   ("caught: ..."), and its next product is refused ("refused: ...").
    raise_allreduce  like raise, with method="allreduce" (with OSMM_ALLREDUCE=native, the
                   all-reduce is osmm_jax's own and bounded in raise mode).

Prints "ready <unix time>" on stderr when the divergence starts. The job must end non-zero
with the watchdog's report on stderr (OSMM_TIMEOUT defaults to 5 s here).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OSMM_TIMEOUT", "5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import osmm_jax as om  # noqa: E402

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def product(plan, method=None):
    """A jitted product under ``plan`` and this rank's blocks of its inputs."""
    m, k = plan.a.shape
    _, n = plan.b.shape
    rng = np.random.default_rng(0)
    a = jnp.asarray(plan.a.shard(rng.standard_normal((m, k)).astype(np.float32), RANK))
    b = jnp.asarray(plan.b.shard(rng.standard_normal((k, n)).astype(np.float32), RANK))
    fn = jax.jit(lambda x, y: om.matmul(x, y, plan, method=method))
    return lambda: jax.block_until_ready(fn(a, b))


def main(scenario: str) -> None:
    p_plan = om.plan(om.Layout.cols((8, 12)), om.Layout.rows((12, 6)), om.Layout.rows((8, 6)))
    p = product(p_plan)
    q = product(om.plan(om.Layout.rows((9, 5)), om.Layout.cols((5, 7)), om.Layout.cols((9, 7))))
    if scenario in ("extra", "extra_allreduce"):
        if scenario == "extra_allreduce":
            p = product(p_plan, "allreduce")
        for _ in range(3):
            p()
        print(f"ready {time.time():.3f}", file=sys.stderr, flush=True)
        if RANK == 0:
            p()
    elif scenario in ("raise", "raise_allreduce"):
        if scenario == "raise_allreduce":
            p = product(p_plan, "allreduce")
        for _ in range(3):
            p()
        print(f"ready {time.time():.3f}", file=sys.stderr, flush=True)
        if RANK == 0:
            with om.timeout(3, "raise"):
                try:
                    p()
                except Exception as err:  # noqa: BLE001 - reported for the test to read
                    print(f"caught: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                try:
                    p()
                except Exception as err:  # noqa: BLE001
                    print(f"refused: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    elif scenario in ("swapped", "swapped_first", "swapped_same"):
        if scenario == "swapped_same":
            q = product(
                om.plan(om.Layout.cols((6, 10)), om.Layout.rows((10, 4)), om.Layout.rows((6, 4)))
            )
        if scenario != "swapped_first":
            p()
            q()
        print(f"ready {time.time():.3f}", file=sys.stderr, flush=True)
        first, second = (p, q) if RANK == 0 else (q, p)
        first()
        second()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(f"rank {RANK} reached the end", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
