"""The character-level language model example trains like one process, data and tensor parallel.

Runs ``examples/train_lm.py --check`` at a tiny size (one block, a few steps, uneven
``--speeds``) in ``dp`` and ``tp`` mode, on 1 rank (plain Python) and on 3 ranks (``mpiexec -n
3``, a subprocess with a hard timeout): each run compares every step's loss with the
single-process reference on rank 0 and exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROGRAM = REPO / "examples" / "train_lm.py"
HARD_TIMEOUT_S = 120.0
TINY = ["--check", "--steps", "3", "--batch", "6", "--context", "8", "--d", "16", "--heads", "4"]
TINY += ["--layers", "1", "--chars", "4000"]

pytest.importorskip("flax")
pytest.importorskip("optax")

_JOB_VARIABLES = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPIR_", "MPI_LOCAL")


def _run(ranks: int, mode: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_VARIABLES)}
    env.update(JAX_PLATFORMS="cpu", OSMM_TIMEOUT="60")
    speeds = ",".join(["1", "1", "2"][:ranks] if ranks == 3 else ["1"] * ranks)
    command = [sys.executable, str(PROGRAM), "--mode", mode, "--speeds", speeds, *TINY]
    if ranks > 1:
        command = [str(MPIEXEC), "-n", str(ranks), *command]
    job = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = job.communicate(timeout=HARD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"still running after {HARD_TIMEOUT_S:.0f} s:\n{output}")
    assert job.returncode == 0, output
    return output


@pytest.mark.parametrize("mode", ["dp", "tp"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_losses_agree_with_one_process(ranks, mode):
    if ranks > 1 and not MPIEXEC.exists():
        pytest.skip("needs the venv's mpiexec")
    output = _run(ranks, mode)
    assert "OK" in output and "MISMATCH" not in output, output
    assert f"{mode} loss" in output and "single loss" in output, output
    assert "tokens/s" in output, output
