"""Speed declarations (OSMM_SPEEDS), without MPI; measuring runs in tests/mpi/test_speeds.py."""

from __future__ import annotations

import pytest

from osmm_jax._src.speeds import declared_speeds

# -- declared speeds (OSMM_SPEEDS) ------------------------------------------------------


def test_declared_speeds_from_the_environment(monkeypatch):
    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    assert declared_speeds(4) is None
    monkeypatch.setenv("OSMM_SPEEDS", "  ")
    assert declared_speeds(4) is None
    monkeypatch.setenv("OSMM_SPEEDS", "300, 300,125,125.5")
    speeds = declared_speeds(4)
    assert speeds.dtype == "float64" and speeds.tolist() == [300, 300, 125, 125.5]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("300,300,125", "has 3 values but there are 4 ranks"),
        ("300,300,125,125,1", "has 5 values but there are 4 ranks"),
        ("300,300,fast,125", "expected comma-separated GFLOP/s per rank"),
        ("300,300,,125", "expected comma-separated GFLOP/s per rank"),
        ("300,0,125,125", "rank 1's speed is 0.0; speeds must be finite and > 0"),
        ("300,-3,125,125", "rank 1's speed is -3.0"),
        ("300,inf,125,125", "rank 1's speed is inf"),
        ("300,300,nan,125", "rank 2's speed is nan"),
    ],
)
def test_declared_speeds_are_validated(monkeypatch, value, match):
    monkeypatch.setenv("OSMM_SPEEDS", value)
    with pytest.raises(ValueError, match=match) as info:
        declared_speeds(4)
    assert "OSMM_SPEEDS" in str(info.value)
