"""The last rank of a job of osmm_jax products fails; the whole job must end soon, with a report.

    mpiexec -n N python tests/failure_programs/failing_rank.py HOW

HOW is how the last rank fails between two products, while the others go on to the next
product and wait for it there: ``exit7`` (``os._exit(7)``), ``sigkill``, ``segfault`` (SIGSEGV
from itself), ``exception`` (an uncaught Python exception), ``sigstop`` (it freezes after the
others are inside the product's fence), ``linkdown`` (it takes its host's network link
down, then waits in the product: a partitioned host; needs root in a network namespace of
its own) or ``xlaerror`` (its part of the next product fails, as if XLA had failed between
the reduce's start and finish, and the error is not caught). ``exit7-fence``,
``sigkill-fence`` and ``segfault-fence`` die the same way but inside a product, while the
others wait in its closing fence: the last rank's part of the product stops between the
reduce's start (opening fence and transfers done) and finish (as ``xlaerror``), it catches
the error and dies instead of going on to the closing fence.

All ranks first run a few small K-split products under ``jax.jit`` (the windows exist, the
function is compiled). Just before failing the last rank prints ``FAILURE <time.time()>`` on
stderr, so the caller can time the job's end. A rank that gets through the products after the
failure says so and exits with status 4. OSMM_TIMEOUT (default here 5 s) bounds the waits.
"""

from __future__ import annotations

import os

os.environ.setdefault("OSMM_TIMEOUT", "5")

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import osmm_jax as om  # noqa: E402
from osmm_jax._src.runtime import native  # noqa: E402

BETWEEN = ("exit7", "sigkill", "segfault", "exception", "sigstop", "linkdown", "xlaerror")
INSIDE = ("exit7-fence", "sigkill-fence", "segfault-fence")
HOWS = BETWEEN + INSIDE
WARMUP = 3
# linkdown: the FAILURE line must reach mpiexec before the link goes down, so it is printed
# this long ahead, with the time the link goes down.
FORWARD_S = 0.5


def fail(how: str, rank: int) -> None:
    ahead = FORWARD_S if how == "linkdown" else 0.0
    at = time.time() + ahead
    print(f"FAILURE {at:.6f} rank {rank} fails by {how}", file=sys.stderr, flush=True)
    time.sleep(ahead)
    if how == "exit7":
        os._exit(7)
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "exception":
        raise RuntimeError(f"rank {rank} gives up between products")
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif how == "linkdown":
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    elif how == "xlaerror":
        native.inject_failure("osmm_reduce_finish")


def die_in_product(how: str, rank: int, run_product) -> None:
    """Start a product with the others, stop before its closing fence, then fail by ``how``
    while the others wait in that fence."""
    native.inject_failure("osmm_reduce_finish")
    try:
        run_product().block_until_ready()
    except Exception:  # the injected failure, as intended
        pass
    else:
        raise AssertionError("the injected failure did not stop the product")
    time.sleep(0.5)  # the others are in the closing fence by now
    fail(how, rank)


def main() -> None:
    how = sys.argv[1] if len(sys.argv) == 2 else ""
    if how not in HOWS:
        raise SystemExit(f"usage: failing_rank.py {{{','.join(HOWS)}}}")
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    failing = size - 1

    # K split over the ranks: every product needs every rank.
    a, b = om.Layout.cols((24, 12 * size)), om.Layout.rows((12 * size, 16))
    c = om.Layout.rows((24, 16))
    plan = om.plan(a, b, c)
    product = jax.jit(lambda u, v: om.matmul(u, v, plan))
    x = np.arange(24 * 12 * size, dtype=np.float32).reshape(24, -1) / x_scale(size)
    y = np.arange(12 * size * 16, dtype=np.float32).reshape(-1, 16) / x_scale(size)
    u, v = a.shard(x, rank), b.shard(y, rank)
    for _ in range(WARMUP):
        out = product(u, v).block_until_ready()
    np.testing.assert_allclose(out, c.shard(x @ y, rank), rtol=1e-4)
    comm.Barrier()

    if rank == failing and how in INSIDE:
        die_in_product(how.removesuffix("-fence"), rank, lambda: product(u, v))
    elif rank == failing:
        if how == "sigstop":
            time.sleep(1.0)  # the others are in the product's fence by now
        fail(how, rank)
    try:
        for _ in range(100):
            out = product(u, v).block_until_ready()
    except Exception as error:  # raise mode: the product raised instead of ending the job
        print(f"RAISED {time.time():.6f} rank {rank}: {error}", file=sys.stderr, flush=True)
        raise
    print(f"rank {rank}: products went on after rank {failing} failed", file=sys.stderr, flush=True)
    os._exit(4)


def x_scale(size: int) -> float:
    return float(24 * 12 * size)


if __name__ == "__main__":
    main()
