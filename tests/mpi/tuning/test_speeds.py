"""profile_speeds(): measured, cached and declared GEMM rates, the same on every rank."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from osmm_jax._src.tuning.speeds import SpeedProfile, profile_speeds

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
# Nothing checked here changes from three ranks to four (uneven splits and a rank with nothing
# appear from 3 on); the 4-rank run is for the 2x2 grids, the notified reduce's origin rounds and
# the tensor-parallel replica groups.
pytestmark = pytest.mark.ranks(1, 2, 3, reason="three ranks cover it")
SMALL = {"size": 256, "repeats": 3, "progress": False}


@pytest.fixture
def shared_dir():
    """A fresh directory, the same path on every rank (made by rank 0), removed afterwards."""
    path = tempfile.mkdtemp(prefix="osmm_speeds_") if RANK == 0 else None
    path = MPI.COMM_WORLD.bcast(path, root=0)
    yield path
    MPI.COMM_WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(path, ignore_errors=True)


def _same_everywhere(values) -> None:
    everyone = MPI.COMM_WORLD.allgather(np.asarray(values).tolist())
    assert all(v == everyone[0] for v in everyone), everyone


def test_measured_speeds_are_identical_on_every_rank(monkeypatch):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    speeds = profile_speeds(**SMALL)
    assert isinstance(speeds, np.ndarray) and speeds.dtype == np.float64
    assert speeds.shape == (SIZE,)
    assert np.all(np.isfinite(speeds)) and np.all(speeds > 0)
    _same_everywhere(speeds)
    profile = profile_speeds(return_profile=True, **SMALL)
    assert isinstance(profile, SpeedProfile) and profile.source == "measured"
    assert profile.spread.shape == (SIZE,) and np.all(profile.spread >= 0)
    _same_everywhere(profile.spread)


def test_cache_round_trip(monkeypatch, shared_dir):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    path = os.path.join(shared_dir, "speeds.json")
    first = profile_speeds(cache=path, return_profile=True, **SMALL)
    assert first.source == "measured"
    with open(path) as f:
        entries = json.load(f)["entries"]
    assert sorted(key.split("|")[0] for key in entries) == [f"rank {r}/{SIZE}" for r in range(SIZE)]
    assert all(key.endswith(f"|{SMALL['size']}|float32") for key in entries)

    second = profile_speeds(cache=path, return_profile=True, **SMALL)
    assert second.source == "cache"
    np.testing.assert_array_equal(second.gflops, first.gflops)
    np.testing.assert_array_equal(second.spread, first.spread)
    _same_everywhere(second.gflops)

    # Another size is another key: measured again, not read.
    assert profile_speeds(cache=path, return_profile=True, size=128, repeats=2).source == "measured"


def test_one_rank_missing_its_entry_makes_every_rank_measure(monkeypatch, shared_dir):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    full = os.path.join(shared_dir, "full.json")
    empty = os.path.join(shared_dir, "empty.json")
    profile_speeds(cache=full, **SMALL)
    mine = empty if RANK == SIZE - 1 else full
    profile = profile_speeds(cache=mine, return_profile=True, **SMALL)
    assert profile.source == "measured"  # on every rank, none waiting for the others
    _same_everywhere(profile.gflops)


def test_declared_speeds_by_argument_and_environment(monkeypatch):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    declared = [100.0 + r for r in range(SIZE)]
    profile = profile_speeds(speeds=declared, return_profile=True)
    assert profile.source == "declared"
    assert profile.gflops.tolist() == declared and profile.spread.tolist() == [0.0] * SIZE

    monkeypatch.setenv("OSMM_SPEEDS", ",".join(str(300 - r) for r in range(SIZE)))
    speeds = profile_speeds()
    assert speeds.tolist() == [300.0 - r for r in range(SIZE)]
    # The argument wins over the environment.
    assert profile_speeds(speeds=declared).tolist() == declared


def test_bad_declared_speeds_raise_on_every_rank(monkeypatch):
    monkeypatch.setenv("OSMM_SPEEDS", ",".join(["100"] * (SIZE + 1)))
    with pytest.raises(ValueError, match=f"has {SIZE + 1} values but there are {SIZE} ranks"):
        profile_speeds()
    monkeypatch.delenv("OSMM_SPEEDS")
    with pytest.raises(ValueError, match="speeds must be finite and > 0"):
        profile_speeds(speeds=[0.0] * SIZE)
    with pytest.raises(TypeError, match="cache must be None, True or a path"):
        profile_speeds(cache=3, **SMALL)


@pytest.mark.ranks(min=2, reason="a rank cannot disagree with itself")
def test_ranks_that_disagree_all_get_an_error(monkeypatch):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    if RANK == 0:
        monkeypatch.setenv("OSMM_SPEEDS", ",".join(["100"] * SIZE))
    with pytest.raises(ValueError, match="ranks disagree"):
        profile_speeds(**SMALL)
    # A bad argument on one rank only: every rank raises, naming it.
    bad = SIZE - 1
    with pytest.raises(ValueError, match=f"rank {bad}: repeats must be at least 1"):
        profile_speeds(size=256, repeats=0 if RANK == bad else 3, progress=False)
