"""The character-level language model example trains like one process: data, tensor and tensor
with sequence parallel on osmm_jax, and data parallel on JAX's own sharding.

Runs ``examples/train_lm.py --check`` at a tiny size (one block, a few steps, uneven
``--speeds``) in ``dp``, ``tp`` and ``sp`` mode on 3 ranks (``mpiexec -n 3``, a subprocess
with a hard timeout), in ``jax`` mode on 2 (it ignores the speeds and splits evenly, so a
third rank would only add a process to compile on these 2 cores), and once as
plain Python on 1 rank in the default mode, ``dp`` (the example without mpiexec; the 3-rank
runs check each mode's layers): each run compares every step's loss with the single-process
reference on rank 0 and exits non-zero on a mismatch.

With ``--budgets`` (memory per rank, 1 : 4 : 4, speeds 1 : 1 : 2) the smallest budget holds
rank 0 below its speed share of the sequences (``dp``) or heads (``tp``) and the training
still agrees with one process; budgets too small for any split end every rank at once with an
error naming the rank.
"""

from __future__ import annotations

import re
import sys

import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, run_job

PROGRAM = REPO / "examples" / "train_lm.py"
HARD_TIMEOUT_S = 300.0  # a loaded 2-core machine compiles 3 ranks slowly
TINY = ["--check", "--steps", "3", "--batch", "6", "--context", "8", "--d", "16", "--heads", "4"]
TINY += ["--layers", "1", "--chars", "4000"]

pytest.importorskip("osmm_jax.flax", exc_type=ImportError)
pytest.importorskip("optax")


# At the tiny size a rank holds 93.5 KiB in dp whatever its share, plus 15.9 KiB a sequence
# (examples/lm_memory.py); in tp 91 KiB, plus 10.2 KiB a head: 112 KiB leaves rank 0 room
# for one sequence (its speed share is 1.5) and no head (its share is 1).
BUDGETS = "112KiB,448KiB,448KiB"


def _run(ranks: int, mode: str, *extra: str, status: int = 0) -> str:
    env = job_environment(JAX_PLATFORMS="cpu", OSMM_TIMEOUT="60")
    speeds = ",".join(["1", "1", "2"][:ranks] if ranks == 3 else ["1"] * ranks)
    command = [sys.executable, str(PROGRAM), "--mode", mode, "--speeds", speeds, *TINY, *extra]
    if ranks > 1:
        command = [*mpiexec(ranks), *command]
    end = run_job(command, env, HARD_TIMEOUT_S, merge_stderr=True)
    if end.status is None:
        pytest.fail(f"still running after {HARD_TIMEOUT_S:.0f} s:\n{end.stdout}")
    assert end.status == status, end.stdout
    return end.stdout


@pytest.mark.parametrize("ranks, mode", [(3, "dp"), (3, "tp"), (3, "sp"), (2, "jax"), (1, "dp")])
def test_losses_agree_with_one_process(ranks, mode):
    if ranks > 1 and not MPIEXEC.exists():
        pytest.skip("needs the venv's mpiexec")
    output = _run(ranks, mode)
    assert "OK" in output and "MISMATCH" not in output, output
    assert f"{mode} loss" in output and "single loss" in output, output
    assert "tokens/s" in output, output


def _per_rank(output: str, label: str) -> list[int]:
    """The sizes the example printed after ``label`` (``sequences per rank: [1, 2, 3]``)."""
    found = re.search(re.escape(label) + r": \[(\d+), (\d+), (\d+)\]", output)
    assert found, output
    return [int(n) for n in found.groups()]


@pytest.mark.parametrize("mode, label, total", [("dp", "sequences", 6), ("tp", "heads", 4)])
def test_a_small_memory_budget_holds_a_rank_below_its_speed_share(mode, label, total):
    if not MPIEXEC.exists():
        pytest.skip("needs the venv's mpiexec")
    output = _run(3, mode, "--budgets", BUDGETS)
    sizes = _per_rank(output, f"{label} per rank")
    assert sum(sizes) == total, output
    assert sizes[0] < total * 1 / 4, output  # speeds 1 : 1 : 2: rank 0's share is a quarter
    assert f"rank 0 held to {sizes[0]} {label} by its memory budget" in output, output
    assert "held below their speed share by memory: rank 0\n" in output, output
    assert re.search(r"rank 0: predicted [\d.]+ KiB of its 112 KiB budget", output), output
    assert "peak resident memory per rank" in output and "rank 2 " in output, output
    assert "OK" in output and "MISMATCH" not in output, output


@pytest.mark.parametrize(
    "mode, budgets, message",
    [
        ("dp", "1KiB,4KiB,4KiB", r"rank 0 has 1 KiB but needs [\d.]+ KiB whatever its share"),
        ("tp", "1KiB,4KiB,4KiB", r"rank 0 has 1 KiB but needs [\d.]+ KiB whatever its share"),
        # Every rank holds its parameters, but not the 6 sequences between them.
        ("dp", "100KiB,120KiB,120KiB", "6 rows do not fit the memory budgets: rank 2 would"),
    ],
)
def test_budgets_too_small_end_every_rank_with_an_error_naming_the_rank(mode, budgets, message):
    if not MPIEXEC.exists():
        pytest.skip("needs the venv's mpiexec")
    output = _run(3, mode, "--budgets", budgets, status=2)
    assert "train_lm.py: error: --budgets: " in output, output
    assert re.search(message, output), output
    assert "Traceback" not in output and "loss" not in output, output
