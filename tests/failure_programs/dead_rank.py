"""One rank of a 3-rank job of osmm_jax products dies; the job must still end, soon, with an error.

    mpiexec -n 3 python tests/failure_programs/dead_rank.py HOW WHERE

HOW is how rank 1 dies: ``sigkill`` (SIGKILL from itself), ``segfault`` (SIGSEGV from itself),
``exit3`` (``os._exit(3)``) or ``exit0`` (``os._exit(0)``: a clean status, but no MPI_Finalize).
WHERE is what the other ranks are doing then: ``inside`` a product (they call it at once and
wait in its fence for rank 1, which sleeps, then dies instead of calling it) or ``between``
products (rank 1 dies at once while they sleep, then they call the product and wait).

All ranks first run a few products together under ``jax.jit``, so the windows exist and the
function is compiled. Just before dying rank 1 prints ``DEATH <time.time()>`` on stderr, so the
caller can time how long the job takes to end after the death. The other ranks never return
from the product they wait in; if one did, it would say so on stderr and exit with status 4.
OSMM_TIMEOUT (default here 10 s) bounds osmm_jax's own blocking steps.
"""

from __future__ import annotations

import os

os.environ.setdefault("OSMM_TIMEOUT", "10")

import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import osmm_jax as om  # noqa: E402

HOWS = ("sigkill", "segfault", "exit3", "exit0")
WHERES = ("inside", "between")
DYING = 1
WARMUP = 3


def die(how: str) -> None:
    print(f"DEATH {time.time():.6f} rank {DYING} dies by {how}", file=sys.stderr, flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "exit3":
        os._exit(3)
    elif how == "exit0":
        os._exit(0)
    raise AssertionError(f"rank {DYING} is still alive after {how}")


def main() -> None:
    how, where = sys.argv[1:3]
    if how not in HOWS or where not in WHERES:
        raise SystemExit(f"usage: dead_rank.py {{{','.join(HOWS)}}} {{{','.join(WHERES)}}}")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != 3:
        raise SystemExit(f"dead_rank.py runs on 3 ranks, not {size}")

    a, b, c = om.Layout.rows((48, 32)), om.Layout.rows((32, 40)), om.Layout.rows((48, 40))
    plan = om.plan(a, b, c)
    product = jax.jit(lambda u, v: om.matmul(u, v, plan))
    x = np.arange(48 * 32, dtype=np.float32).reshape(48, 32) / 1536
    y = np.arange(32 * 40, dtype=np.float32).reshape(32, 40) / 1280
    u, v = a.shard(x, rank), b.shard(y, rank)
    for _ in range(WARMUP):
        out = product(u, v).block_until_ready()
    np.testing.assert_allclose(out, c.shard(x @ y, rank), rtol=1e-5)
    comm.Barrier()

    if rank == DYING:
        if where == "inside":
            time.sleep(1.0)  # the others are in the product's fence by now
        die(how)
    if where == "between":
        time.sleep(1.0)  # rank 1 is dead by now
    for _ in range(100):
        out = product(u, v).block_until_ready()
    print(f"rank {rank}: products went on without rank {DYING}", file=sys.stderr, flush=True)
    os._exit(4)


if __name__ == "__main__":
    main()
