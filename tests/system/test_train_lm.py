"""The character-level language model example trains like one process: data, tensor and tensor
with sequence parallel on osmm_jax, and data parallel on JAX's own sharding.

Runs ``examples/train_lm.py --check`` at a tiny size (one block, a few steps, uneven
``--speeds``) in ``dp``, ``tp`` and ``sp`` mode on 3 ranks (``mpiexec -n 3``, a subprocess
with a hard timeout), in ``jax`` mode on 2 (it ignores the speeds and splits evenly, so a
third rank would only add a process to compile on these 2 cores), and once as
plain Python on 1 rank in the default mode, ``dp`` (the example without mpiexec; the 3-rank
runs check each mode's layers): each run compares every step's loss with the single-process
reference on rank 0 and exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, run_job

PROGRAM = REPO / "examples" / "train_lm.py"
HARD_TIMEOUT_S = 300.0  # a loaded 2-core machine compiles 3 ranks slowly
TINY = ["--check", "--steps", "3", "--batch", "6", "--context", "8", "--d", "16", "--heads", "4"]
TINY += ["--layers", "1", "--chars", "4000"]

pytest.importorskip("osmm_jax.flax", exc_type=ImportError)
pytest.importorskip("optax")


def _run(ranks: int, mode: str) -> str:
    env = job_environment(JAX_PLATFORMS="cpu", OSMM_TIMEOUT="60")
    speeds = ",".join(["1", "1", "2"][:ranks] if ranks == 3 else ["1"] * ranks)
    command = [sys.executable, str(PROGRAM), "--mode", mode, "--speeds", speeds, *TINY]
    if ranks > 1:
        command = [*mpiexec(ranks), *command]
    end = run_job(command, env, HARD_TIMEOUT_S, merge_stderr=True)
    if end.status is None:
        pytest.fail(f"still running after {HARD_TIMEOUT_S:.0f} s:\n{end.stdout}")
    assert end.status == 0, end.stdout
    return end.stdout


@pytest.mark.parametrize("ranks, mode", [(3, "dp"), (3, "tp"), (3, "sp"), (2, "jax"), (1, "dp")])
def test_losses_agree_with_one_process(ranks, mode):
    if ranks > 1 and not MPIEXEC.exists():
        pytest.skip("needs the venv's mpiexec")
    output = _run(ranks, mode)
    assert "OK" in output and "MISMATCH" not in output, output
    assert f"{mode} loss" in output and "single loss" in output, output
    assert "tokens/s" in output, output
