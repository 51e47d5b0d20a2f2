"""Heterogeneous ranks, emulated for real by CPU binding.

Runs only under ``mpiexec -n 3 -bind-to user:0,0,1`` (``make test`` runs it so):
ranks 0 and 1 share core 0, rank 2 has core 1 to itself, so rank 2 computes
about twice as fast on a quiet machine. Elsewhere every test here is skipped, saying why.
The checks are orderings measured in one run (rank 2 the fastest; the balanced split
sooner and closer than the even one), not magnitudes: this machine's host can take a share
of either core for a while. Each still fails if the mechanism it checks does not work.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import pytest
from mpi4py import MPI

import osmm_jax as om

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
AFFINITIES = COMM.allgather(sorted(os.sched_getaffinity(0)))

pytestmark = [
    pytest.mark.ranks(3, reason="two ranks share a core, the third has one to itself"),
    pytest.mark.skipif(
        SIZE == 3
        and (
            AFFINITIES[0] != AFFINITIES[1]
            or len(AFFINITIES[0]) != 1
            or AFFINITIES[2] == AFFINITIES[0]
        ),
        reason="needs mpiexec -n 3 -bind-to user:0,0,1 (ranks 0 and 1 on one core, rank 2 on another)",
    ),
]


def _share_seconds(rows: int, k: int = 1024, n: int = 1024, repeats: int = 7) -> list[float]:
    """Every rank's median time to multiply its ``rows`` x k block by a k x n matrix, all at once."""
    return _interleaved_seconds([rows], k, n, repeats)[0]


def _interleaved_seconds(
    rows_per_split: list[int], k: int = 1024, n: int = 1024, repeats: int = 9
) -> list[list[float]]:
    """For each of this rank's row counts, every rank's median seconds to multiply that many
    rows of a k-wide block by a k x n matrix, all ranks at once.

    The splits' runs alternate within each repeat, so a burst of the machine's other load
    falls on every split alike instead of on whichever was measured during it.
    """
    b = jnp.ones((k, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    blocks = [jnp.ones((rows, k), jnp.float32) for rows in rows_per_split]
    for a in blocks:
        dot(a, b).block_until_ready()
    times: list[list[float]] = [[] for _ in blocks]
    for _ in range(repeats):
        for a, split_times in zip(blocks, times):
            COMM.Barrier()
            start = time.perf_counter()
            dot(a, b).block_until_ready()
            split_times.append(time.perf_counter() - start)
    return [COMM.allgather(statistics.median(t)) for t in times]


def _spread(seconds: list[float]) -> float:
    """How far the slowest rank is behind the fastest, as a fraction of the fastest."""
    return (max(seconds) - min(seconds)) / min(seconds)


def test_profile_speeds_finds_the_rank_alone_on_its_core_the_fastest():
    """Rank 2, alone on its core, profiles faster than each of ranks 0 and 1, which share one;
    every rank holds the same speeds. How much faster (about 2x on a quiet machine, 1.27x in
    one clean-clone run while the host took a share of core 1) is a benchmark's figure, not a
    test's. Up to five profiles: every rank holds the same speeds, so all ranks decide alike
    whether to profile again."""
    for _ in range(5):
        speeds = om.profile_speeds(size=1024, repeats=7, progress=False)
        assert len(set(map(tuple, COMM.allgather(speeds.tolist())))) == 1
        if speeds[2] > 1.05 * max(speeds[:2]):
            break
    assert speeds[2] > 1.05 * max(speeds[:2]), f"measured speeds {speeds}: rank 2 not the fastest"


def test_balanced_rows_finish_sooner_and_closer_together_than_an_even_split():
    """The split from measured speeds against the even split, timed in the same run.

    With ranks 0 and 1 sharing a core, an even split leaves them about 2x behind rank 2
    (a spread near 100%); the balanced split gives rank 2 the most rows and brings the
    ranks within a fraction of that. Both splits are timed interleaved, so the machine's
    other load cannot favour one; how close the balanced ranks come is a benchmark's figure
    (benchmarks/lm_step.py). Up to five attempts, each from fresh speeds: every rank holds
    the same gathered times, so all decide alike whether to try again. (The host can take a
    share of core 1 for a while, leaving rank 2 only 1.3x faster and the even split's spread
    near 30%: hence "closer" asks for less spread, not for a factor.)
    """
    total, probe_rows = 6144, 2048
    even = om.balance(total, [1.0] * SIZE, min_rows=64).sizes
    history = []
    for _ in range(5):
        speeds = [probe_rows / t for t in _share_seconds(probe_rows)]
        balanced = om.balance(total, speeds, min_rows=64).sizes
        even_s, balanced_s = _interleaved_seconds([even[RANK], balanced[RANK]])
        history.append((balanced, [round(t, 4) for t in even_s], [round(t, 4) for t in balanced_s]))
        sooner = max(balanced_s) < max(even_s)
        closer = _spread(balanced_s) < _spread(even_s)
        if sooner and closer and balanced[2] > max(balanced[:2]):
            break
    assert balanced[2] > max(balanced[:2]), f"rank 2 should take the most rows: {history}"
    assert sooner, (
        f"balanced rows should finish before even rows (rows, even s, balanced s): {history}"
    )
    assert closer, (
        f"balanced spread {_spread(balanced_s):.0%} should be under the even split's "
        f"{_spread(even_s):.0%} (rows, even s, balanced s): {history}"
    )
