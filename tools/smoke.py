"""Smoke test for a new machine: distributed products and both their gradients, with both
methods, checked against numpy in float64.

Run on every rank of a job, on the platform JAX_PLATFORMS selects (cpu or cuda)::

    .venv/bin/mpiexec -n 2 .venv/bin/python tools/smoke.py
    JAX_PLATFORMS=cuda .venv/bin/mpiexec -n 2 .venv/bin/python tools/smoke.py --cuda-aware

Two products: a K-split (A by columns, B by rows, C by rows: partials delivered by RMA) and a
data-parallel layer (A and C by rows, B replicated: B's gradient summed over ranks). For each,
the forward result and the gradients of A and B, by ``one_sided`` and by ``allreduce``.

``--cuda-aware`` checks CUDA-aware mode (``OSMM_CUDA_AWARE=1``, windows in GPU memory): where
the MPI reports CUDA support the products must be right; where it does not, the first product
must fail on every rank with the error that says so (never a hang or a wrong result).

Prints one line per check on rank 0 and exits non-zero on any rank if any check failed.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om
from osmm_jax._src.runtime import native

# Checked at float32's accuracy: no TF32 dots on GPUs (the default there for float32).
jax.config.update("jax_default_matmul_precision", "highest")

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
NOT_CUDA_AWARE = "OSMM_CUDA_AWARE=1 asks for windows in GPU memory"


def _say(text: str) -> None:
    if RANK == 0:
        print(text, flush=True)


def _layouts(case: str, m: int, k: int, n: int):
    if case == "k_split":
        return om.Layout.cols((m, k)), om.Layout.rows((k, n)), om.Layout.rows((m, n))
    return om.Layout.rows((m, k)), om.Layout.replicated((k, n)), om.Layout.rows((m, n))


def _check_case(case: str, method: str, rng: np.random.Generator) -> list[str]:
    """The problems found in one product and its gradients (empty: all right)."""
    m, k, n = 96, 80, 72
    a_layout, b_layout, c_layout = _layouts(case, m, k, n)
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, dc = (rng.standard_normal(s) for s in ((m, k), (k, n), (m, n)))
    a_local = jnp.asarray(a_layout.shard(a, RANK), jnp.float32)
    b_local = jnp.asarray(b_layout.shard(b, RANK), jnp.float32)
    dc_local = jnp.asarray(c_layout.shard(dc, RANK), jnp.float32)

    @jax.jit
    def step(x, w, cotangent):
        c, vjp = jax.vjp(lambda x, w: om.matmul(x, w, plan, method=method), x, w)
        return (c, *vjp(cotangent))

    c_local, da_local, db_local = step(a_local, b_local, dc_local)
    results = {
        "C": (om.gather(c_local, c_layout), a @ b),
        "dA": (om.gather(da_local, a_layout), dc @ b.T),
        "dB": (om.gather(db_local, b_layout), a.T @ dc),
    }
    problems = []
    for name, (got, want) in results.items():
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        if not np.isfinite(error) or error > 1e-5:
            problems.append(f"{name}: relative error {error:.2e} (float32 limit 1e-5)")
    return problems


def _run_checks() -> bool:
    rng = np.random.default_rng(1234)  # the same inputs on every rank
    ok = True
    staged_before = om.stats()["staged_bytes"]
    for case in ("k_split", "data_parallel"):
        for method in ("one_sided", "allreduce"):
            problems = _check_case(case, method, rng)
            problems = sorted({p for ps in COMM.allgather(problems) for p in ps})
            ok &= not problems
            _say(f"{case:14s} {method:10s} {'ok' if not problems else '; '.join(problems)}")
    if jax.default_backend() == "gpu" and os.environ.get("OSMM_CUDA_AWARE") != "1":
        # Host-staged: the CUDA handlers (not the CPU ones) ran if they copied through host memory.
        staged = COMM.allreduce(om.stats()["staged_bytes"] - staged_before)
        ok &= staged > 0
        _say(f"staging        {'ok' if staged > 0 else 'NONE'} ({staged} bytes over all ranks)")
    return ok


def _expect_not_cuda_aware() -> bool:
    """The first product must fail on every rank with the error naming OSMM_CUDA_AWARE."""
    try:
        _check_case("k_split", "one_sided", np.random.default_rng(0))
    except Exception as err:  # XLA's runtime error type differs between JAX versions
        message = str(err)
    else:
        message = ""
    messages = COMM.allgather(message)
    ok = all(NOT_CUDA_AWARE in msg for msg in messages)
    first_line = next((msg for msg in messages if msg), "no error").strip().splitlines()[0]
    _say(f"cuda-aware     expected error on every rank: {'ok' if ok else 'NO'} ({first_line})")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda-aware", action="store_true", help="check OSMM_CUDA_AWARE=1")
    args = parser.parse_args(argv)
    platform = jax.default_backend()
    _say(f"{SIZE} ranks, JAX {jax.__version__} on {platform} ({jax.devices()[0].device_kind})")
    if args.cuda_aware:
        if platform != "gpu" or os.environ.get("OSMM_CUDA_AWARE") != "1":
            _say("--cuda-aware needs JAX_PLATFORMS=cuda and OSMM_CUDA_AWARE=1")
            return 2
        support = native.MODULES["cuda"].mpi_cuda_support()
        _say(f"MPIX_Query_cuda_support: {support}")
        ok = _run_checks() if support == 1 else _expect_not_cuda_aware()
    else:
        ok = _run_checks()
    ok = COMM.allreduce(ok, op=MPI.LAND)
    _say("smoke test: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
