"""Whole-process behaviour: imports, the thread-level check, clean exit under mpiexec."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobs import MPIEXEC, mpiexec

REPO = Path(__file__).resolve().parents[2]


def _run(args, timeout=240, env=None):
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_layouts_and_plans_need_neither_jax_nor_mpi():
    code = textwrap.dedent("""
        import sys, osmm_jax as om
        a = om.Layout.rows((6, 4), nranks=3)
        assert om.Layout.grid((4, 4), (2, 2)).nranks == 4
        bad = [m for m in ("jax", "mpi4py", "mpi4jax") if m in sys.modules]
        assert not bad, bad
        assert sorted(om.__all__) == sorted(om._PUBLIC)
        for name in om.__all__:
            getattr(om, name)
    """)
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr


def test_insufficient_thread_level_is_refused_clearly():
    code = textwrap.dedent("""
        import mpi4py
        mpi4py.rc.thread_level = "serialized"
        from mpi4py import MPI
        import osmm_jax as om
        layout = om.Layout.rows((4, 4), nranks=1)
        om.plan(layout, layout, layout)
    """)
    result = _run([sys.executable, "-c", code])
    assert result.returncode != 0
    assert "MPI_THREAD_MULTIPLE" in result.stderr and "MPI_THREAD_SERIALIZED" in result.stderr


# Open MPI 5 prints this once per window wherever UCX is built in but finds no device, whatever
# the program (https://github.com/open-mpi/ompi/issues/12517, open; OMPI_MCA_osc=^ucx silences
# it): Open MPI's start-up noise, not osmm_jax's.
OPEN_MPI_OSC_UCX = "OSC UCX component priority set inside component query failed"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")
def test_program_exits_cleanly_after_one_sided_products():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from mpi4py import MPI
        import osmm_jax as om
        rank = MPI.COMM_WORLD.Get_rank()
        a, b, c = om.Layout.cols((64, 64)), om.Layout.rows((64, 64)), om.Layout.rows((64, 64))
        p = om.plan(a, b, c)
        x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096
        out = jax.jit(lambda u, v: om.matmul(u, v, p))(a.shard(x, rank), b.shard(x, rank))
        np.testing.assert_allclose(out, c.shard(x @ x, rank), rtol=1e-5)
        assert om.stats()["windows"] >= 1
        print("done", rank)
    """)
    result = _run([*mpiexec(2), sys.executable, "-c", code])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("done") == 2
    # Python's warnings span several lines, up to the source line they name ("warnings.warn(":
    # mpi4jax's notice of a jax newer than it declares, shown above compat.TESTED_JAX).
    stderr = re.sub(r"[^\n]*UserWarning:.*?\n\s*warnings\.warn\(\n", "", result.stderr, flags=re.S)
    noise = [
        line
        for line in stderr.splitlines()
        if line.strip() and "UserWarning" not in line and OPEN_MPI_OSC_UCX not in line
    ]
    assert not noise, "stderr should be empty at exit:\n" + result.stderr


def test_a_single_rank_notebook_kernel_is_told_once_how_to_get_more_ranks():
    code = textwrap.dedent("""
        import sys, types
        sys.modules["ipykernel"] = types.ModuleType("ipykernel")  # as inside a Jupyter kernel
        import numpy as np
        import osmm_jax as om
        p = om.plan(om.Layout.rows((4, 4)), om.Layout.replicated((4, 4)), om.Layout.rows((4, 4)))
        om.plan(om.Layout.cols((4, 4)), om.Layout.rows((4, 4)), om.Layout.rows((4, 4)))
        c = om.matmul(np.ones((4, 4), np.float32), np.eye(4, dtype=np.float32), p)
        assert float(c.sum()) == 16.0
    """)
    result = _run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("single MPI rank") == 1
    assert "ipyparallel.Cluster(engines='mpi'" in result.stderr


@pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")
def test_everything_runs_without_mpi4jax_on_osmm_jaxs_own_effect_and_all_reduce():
    """What a plain ``pip install osmm_jax`` (no mpi4jax extra) gives: osmm_jax's own ordered
    effect, and its own all-reduce for the allreduce method and checksum verification. The
    smoke test (both methods, forward and both gradients) and a verified product on 2 ranks."""
    code = textwrap.dedent("""
        import runpy, sys
        sys.modules["mpi4jax"] = None  # as if not installed: importing it raises ImportError
        import jax, numpy as np
        from mpi4py import MPI
        import osmm_jax as om
        from osmm_jax._src import compat
        assert not compat.HAVE_MPI4JAX and str(compat.ordered_effect) == "OrderedOsmmMPI"
        sys.argv = ["smoke.py"]
        try:
            runpy.run_path("tools/smoke.py", run_name="__main__")
        except SystemExit as end:
            assert not end.code, f"smoke test exit status {end.code}"
        rank = MPI.COMM_WORLD.Get_rank()
        plan = om.plan(om.Layout.cols((12, 10)), om.Layout.rows((10, 8)), om.Layout.rows((12, 8)))
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((12, 10)), rng.standard_normal((10, 8))
        verified = jax.jit(lambda x, y: om.matmul(x, y, plan, verify=True))
        c = verified(plan.a.shard(a, rank), plan.b.shard(b, rank))
        np.testing.assert_allclose(np.asarray(c), plan.c.shard(a @ b, rank), rtol=1e-4, atol=1e-4)
        assert "mpi4jax" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("verified product: ok", flush=True)
    """)
    result = _run([*mpiexec(2), sys.executable, "-c", code], env={"JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke test: passed" in result.stdout, result.stdout
    assert result.stdout.count("verified product: ok") == 2, result.stdout
