"""Speed declarations (OSMM_SPEEDS), without MPI; measuring runs in tests/mpi/tuning/test_speeds.py."""

from __future__ import annotations

import pytest

from osmm_jax._src.tuning.speeds import declared_speeds

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


# -- the steps of profile_speeds(), without MPI ---------------------------------------------


class _OneRank:
    """The few communicator calls the steps make, for a job of one rank."""

    def Get_rank(self):
        return 0

    def allgather(self, value):
        return [value]

    def Barrier(self):
        pass


def test_checked_arguments_keep_the_error_for_the_agreement(monkeypatch, tmp_path):
    from osmm_jax._src.tuning.speeds import _agreed_choice, _checked_arguments

    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    args = _checked_arguments(64, 3, "float32", tmp_path / "s.json", None, 2)
    assert args[:3] == (64, 3, "float32") and args.declared is None and args.error is None
    assert args.path == tmp_path / "s.json"
    assert _agreed_choice(args) == "(None, 64, 3, 'float32', True)"
    args = _checked_arguments(64, 3, "float32", None, [1, 2], 2)
    assert args.declared.tolist() == [1.0, 2.0] and args.origin == "declared"
    assert _agreed_choice(args) == "([1.0, 2.0], 64, 3, 'float32', False)"
    monkeypatch.setenv("OSMM_SPEEDS", "5,6")
    args = _checked_arguments(64, 3, "float32", None, None, 2)
    assert args.declared.tolist() == [5.0, 6.0] and args.origin == "declared by OSMM_SPEEDS"
    args = _checked_arguments(64, 0, "float32", None, None, 2)
    assert isinstance(args.error, ValueError) and "repeats" in str(args.error)
    assert args.declared is None and args.dtype == "float32"  # not checked after the error


def test_measured_rates_are_cached_and_read_back(monkeypatch, tmp_path, caplog):
    from osmm_jax._src.tuning import speeds

    monkeypatch.delenv("OSMM_SPEEDS", raising=False)
    monkeypatch.setattr(speeds, "_cache_key", lambda comm, size, dtype: f"key {size} {dtype}")
    monkeypatch.setattr(speeds, "_time_gemm", lambda comm, size, repeats, dtype: (12.5, 0.5))
    path = tmp_path / "speeds.json"
    args = speeds._checked_arguments(32, 2, "float32", path, None, 1)
    assert speeds._cached_profile(_OneRank(), path, 32, "float32", False) == (
        "key 32 float32",
        None,
    )
    with caplog.at_level("WARNING"):
        measured = speeds._measured_profile(_OneRank(), args, "key 32 float32", False)
    assert measured.source == "measured" and measured.gflops.tolist() == [12.5]
    assert "rank 0 CV 0.50 > 0.2" in caplog.text
    key, cached = speeds._cached_profile(_OneRank(), path, 32, "float32", False)
    assert cached.source == "cache" and cached.gflops.tolist() == [12.5]
    assert cached.spread.tolist() == [0.5]


def test_noisy_ranks_in_words():
    from osmm_jax._src.tuning.speeds import _noisy_ranks

    assert _noisy_ranks([0.0, 0.2]) == ""
    assert _noisy_ranks([0.35, 0.01, 1.0]) == "rank 0 CV 0.35, rank 2 CV 1.00"
