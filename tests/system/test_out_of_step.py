"""Ranks that fall out of step never hang the job silently.

Each case runs ``mpiexec -n 3 python tests/failure_programs/out_of_step.py SCENARIO`` with
``OSMM_TIMEOUT=5`` and checks how the job ends: non-zero, within the timeout plus 30 s of the
divergence, with the watchdog's report on stderr naming the call numbers and where every rank
is (the report's format is documented in README, "Failure behaviour").
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass

import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, run_job

PROGRAM = REPO / "tests" / "failure_programs" / "out_of_step.py"
TIMEOUT_S = 5.0  # OSMM_TIMEOUT of the jobs
LIMIT_S = TIMEOUT_S + 30.0  # from the divergence to the end of the job
HARD_TIMEOUT_S = 120.0
EXIT_CODE = 75  # MPI_Abort's code when the watchdog ends the job

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the venv's mpiexec")

_READY = re.compile(r"ready (\d+\.\d+)")


@dataclass(frozen=True)
class Job:
    status: int | None  # None: killed at the hard timeout
    stderr: str
    elapsed: float | None  # seconds from the divergence to the end

    def __str__(self) -> str:
        return f"status {self.status}, {self.elapsed} s after the divergence\n{self.stderr}"


@functools.cache
def _job(scenario: str, sync: str = "fence", allreduce: str = "auto") -> Job:
    env = job_environment(
        JAX_PLATFORMS="cpu",
        OSMM_TIMEOUT=str(TIMEOUT_S),
        OSMM_ON_TIMEOUT="abort",
        OSMM_SYNC=sync,
        OSMM_ALLREDUCE=allreduce,
    )
    command = [*mpiexec(3), sys.executable, str(PROGRAM), scenario]
    end = run_job(command, env, HARD_TIMEOUT_S)
    ready = [float(t) for t in _READY.findall(end.stderr)]
    elapsed = end.ended - min(ready) if ready and end.ended is not None else None
    print(f"{scenario} ({sync}): status {end.status}, ended {elapsed} s after the divergence")
    return Job(end.status, end.stderr, elapsed)


def _ended_by_watchdog(job: Job) -> None:
    assert job.status is not None, f"still running after {HARD_TIMEOUT_S:.0f} s:\n{job}"
    assert job.elapsed is not None and job.elapsed < LIMIT_S, str(job)
    assert job.status == EXIT_CODE, str(job)
    assert "Ending the job: MPI_Abort(MPI_COMM_WORLD, 75)" in job.stderr, str(job)


@pytest.mark.parametrize("sync", ["fence", "notify"])
def test_one_rank_running_one_more_product_is_reported_with_every_ranks_position(sync):
    job = _job("extra", sync)
    _ended_by_watchdog(job)
    report = job.stderr[job.stderr.index("osmm_jax watchdog: rank 0") :]
    where = {
        "fence": r"in the closing MPI_Win_fence",
        "notify": r"in a notified reduce \(waiting for another rank's deliveries or slots\)",
    }[sync]
    assert re.search(r"has waited \d+\.\d s \(limit 5\.0 s\) " + where, report), report
    assert re.search(
        r"rank 0 \(this rank\): in call #(\d+) \(osmm_reduce, id [0-9a-f]{16}\)", report
    )
    # The others finished their products and are in their program's teardown.
    number = int(re.search(r"rank 0 \(this rank\): in call #(\d+)", report).group(1))
    for r in (1, 2):
        assert f"rank {r}: in teardown after its last call #{number - 1}" in report, report
    assert f"furthest: rank 0 at call #{number}; rank 1 at #{number - 1}" in report, report


@pytest.mark.parametrize(
    "allreduce, step",
    [
        ("mpi4jax", "an mpi4jax all-reduce (MPI_Allreduce)"),
        ("native", "an osmm_jax all-reduce (MPI_Iallreduce)"),
    ],
)
def test_a_stuck_all_reduce_of_the_baseline_is_watched_too(allreduce, step):
    job = _job("extra_allreduce", allreduce=allreduce)
    _ended_by_watchdog(job)
    report = job.stderr[job.stderr.index("osmm_jax watchdog: rank 0") :]
    assert f"in {step} of call #" in report, report
    assert re.search(r"furthest: rank 0 at call #(\d+); rank 1 at #\d+; rank 2 at #\d+", report)


def test_ranks_running_two_plans_in_swapped_order_are_reported():
    job = _job("swapped")
    _ended_by_watchdog(job)
    assert "out of step: ranks inside calls run different ones" in job.stderr, str(job)
    assert re.search(r"rank 0 in id [0-9a-f]{16}; ranks 1, 2 in id [0-9a-f]{16}", job.stderr)


SWAPPED_CALLS = {
    # Same windows, same epochs: only the call id in the neighbour's window header differs.
    "fence": r"osmm_reduce: rank \d runs its call #(\d+) \(id [0-9a-f]{16}\) but rank \d runs "
    r"its call #\1 \(id [0-9a-f]{16}\)",
    # Each delivery's stamp carries bits of the call id.
    "notify": r"osmm_reduce \(notified\): rank \d runs its notified product #(\d+) \(id bits "
    r"\d+\) but rank \d delivered for product #\1 \(id bits \d+\)",
}


@pytest.mark.parametrize("sync", sorted(SWAPPED_CALLS))
def test_swapped_plans_whose_epochs_match_are_caught_by_their_call_ids(sync):
    """Two plans whose products move the same windows in the same epochs, run in swapped
    order: found at once by the call ids, without waiting for the timeout."""
    job = _job("swapped_same", sync)
    _ended_by_watchdog(job)
    assert job.elapsed < TIMEOUT_S + 10, str(job)
    message = "found the ranks out of step: " + SWAPPED_CALLS[sync]
    assert re.search(message, job.stderr), str(job)


def test_swapped_plans_met_for_the_first_time_are_refused_before_any_transfer():
    job = _job("swapped_first")
    assert job.status not in (None, 0), str(job)
    assert "ranks disagree" in job.stderr, str(job)


@pytest.mark.parametrize("scenario", ["raise", "raise_allreduce"])
def test_raise_mode_gives_a_catchable_error_and_refuses_the_communicator_afterwards(scenario):
    """Also for the baseline's all-reduce when it is osmm_jax's own (mpi4jax's cannot be
    interrupted: a timeout there ends the job)."""
    job = _job(scenario, allreduce="native")
    # jax.errors.JaxRuntimeError, named XlaRuntimeError by older JAX (0.6).
    error = r"(?:Jax|Xla)RuntimeError"
    caught = rf"caught: {error}: DEADLINE_EXCEEDED: osmm_jax watchdog"
    assert re.search(caught, job.stderr), str(job)
    refused = rf"refused: {error}: FAILED_PRECONDITION: osmm_jax no longer uses"
    assert re.search(refused, job.stderr), str(job)
    assert "rank 0 reached the end" in job.stderr, str(job)
    # The other ranks wait for rank 0 in their teardown: the watchdog still ends the job.
    _ended_by_watchdog(job)
