"""The main job: one training step of a feed-forward layer, split by measured rank speed.

Run on 3 ranks: ``mpiexec -n 3 .venv/bin/python examples/ffn_demo.py`` (``make demo``).

The seed workload is an FFN product X[4096, 4096] @ W[4096, 11008]; scaled here
by ``--scale`` (default 0.5: X[2048, 2048] @ W[2048, 5504]) to fit a small
machine. X (the batch) is split by rows in proportion to each rank's measured
GEMM rate (``osmm_jax.profile_speeds`` and ``osmm_jax.balance``), W is
replicated (data parallel). The forward product needs no communication; the
backward product dW = X.T @ dY is a K-split reduction that osmm_jax delivers
onto every rank one-sidedly (from 3 ranks on, as its plan prints: each rank
sums one slice of dW, by MPI_Accumulate of partials or MPI_Get of the inputs,
whichever moves less, then gets the other slices). The step is
timed for ``one_sided`` and for the ``allreduce`` baseline (mpi4jax), and both
results are checked (Freivalds' random-vector test against float64 numpy).
Exits non-zero on a wrong result.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


def timed(fn, *args, repeats: int):
    """Median wall time of ``fn(*args)`` over ``repeats`` runs after one warm-up, agreed across ranks."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale", type=float, default=0.5, help="fraction of the seed FFN size (4096x4096x11008)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed steps per method (median reported)"
    )
    args = parser.parse_args()
    M, K, N = (max(8, int(round(d * args.scale))) for d in (4096, 4096, 11008))

    speeds = om.profile_speeds(size=512, repeats=5, progress=False)
    split = om.balance(M, speeds, min_rows=8)
    say(f"osmm_jax FFN step: Y[{M}x{N}] = X[{M}x{K}] @ W[{K}x{N}] (float32) on {SIZE} ranks")
    say(
        "measured GEMM rates (GFLOP/s): "
        + ", ".join(f"rank {r}: {s:.1f}" for r, s in enumerate(speeds))
    )
    say(f"rows of X per rank: {list(split.sizes)} (predicted imbalance {split.imbalance:.1%})")

    x_layout = om.Layout.rows((M, K), sizes=split.sizes)
    w_layout = om.Layout.replicated((K, N))
    y_layout = om.Layout.rows((M, N), sizes=split.sizes)
    plan = om.plan(x_layout, w_layout, y_layout)
    _, plan_dw = plan.backward()
    say("\nforward plan:\n" + plan.describe(max_lines=12))
    say("\nbackward plan of dW = X.T @ dY:\n" + plan_dw.describe(max_lines=12))

    rng = np.random.default_rng(RANK)
    x_local = jnp.asarray(rng.standard_normal(x_layout.local_shape(RANK)), jnp.float32)
    g_local = jnp.asarray(rng.standard_normal(y_layout.local_shape(RANK)), jnp.float32)  # dL/dY
    w = jnp.asarray(np.random.default_rng(1234).standard_normal((K, N)) / np.sqrt(K), jnp.float32)

    def step(method):
        @jax.jit
        def run(x, w):
            y, vjp = jax.vjp(lambda w_: om.matmul(x, w_, plan, method=method), w)
            (dw,) = vjp(g_local)
            return y, dw

        return run

    results, times, sent = {}, {}, {}
    for method in ("one_sided", "allreduce"):
        run = step(method)
        results[method] = jax.block_until_ready(run(x_local, w))
        before = om.stats()["rma_bytes"]
        times[method] = timed(run, x_local, w, repeats=args.repeats)
        sent[method] = (om.stats()["rma_bytes"] - before) // (args.repeats + 1)

    # Freivalds' test in float64: Y v = X (W v) per rank, and dW v = sum_r X_r.T (G_r v).
    v = np.random.default_rng(99).standard_normal(N)
    x64, w64, g64 = (np.asarray(t, np.float64) for t in (x_local, w, g_local))
    y_ref = x64 @ (w64 @ v)
    dw_ref = COMM.allreduce(x64.T @ (g64 @ v), op=MPI.SUM)
    ok = True
    for method, (y, dw) in results.items():
        y_err = np.abs(np.asarray(y, np.float64) @ v - y_ref).max() / max(
            np.abs(y_ref).max(), 1e-30
        )
        dw_err = np.abs(np.asarray(dw, np.float64) @ v - dw_ref).max() / max(
            np.abs(dw_ref).max(), 1e-30
        )
        errs = COMM.allgather((y_err, dw_err))
        worst = max(max(e) for e in errs)
        good = worst < 1e-4
        ok &= good
        say(
            f"{method:>9}: step {times[method] * 1e3:8.1f} ms   relative error {worst:.1e}   {'OK' if good else 'WRONG'}"
        )

    bytes_per_rank = COMM.gather(sent["one_sided"])
    predicted = om.rma_bytes(plan_dw, 4, 4)
    say("\nbytes moved by the RMA operations each rank issued per step (measured / planned):")
    if RANK == 0:
        for r in range(SIZE):
            print(
                f"  rank {r}: {bytes_per_rank[r] / 2**20:8.2f} MiB / {predicted[r] / 2**20:8.2f} MiB"
            )
    say(f"\none_sided vs allreduce: {times['allreduce'] / times['one_sided']:.2f}x")
    if not ok:
        say("RESULT CHECK FAILED")
        return 1
    say("result check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
