"""MethodSelector without MPI: ranks' times are injected through ``exchange``."""

from __future__ import annotations

import logging

import pytest

from osmm_jax._src.tuning.fallback import MethodSelector


def run(selector, times_by_method, steps):
    """Feed ``steps`` steps whose (slowest-rank) time depends on the method used."""
    used = []
    for _ in range(steps):
        used.append(selector.method)
        selector.observe(times_by_method[selector.method])
    return used


def three_ranks(local):
    return [local, local * 0.5, local * 0.9]  # this rank is the slowest


def test_probing_alternates_then_keeps_one_sided_when_it_is_faster(monkeypatch):
    monkeypatch.delenv("OSMM_USE_ALLREDUCE", raising=False)
    selector = MethodSelector(window=3, exchange=three_ranks)
    used = run(selector, {"one_sided": 1.0, "allreduce": 1.5}, 12)
    assert used[:6] == ["one_sided", "allreduce"] * 3
    assert used[6:] == ["one_sided"] * 6
    assert selector.fallbacks == 0


def test_falls_back_once_when_one_sided_is_slower_beyond_the_ratio(monkeypatch, caplog):
    monkeypatch.delenv("OSMM_USE_ALLREDUCE", raising=False)
    selector = MethodSelector(window=3, ratio=1.2, exchange=three_ranks)
    with caplog.at_level(logging.WARNING, logger="osmm_jax"):
        used = run(selector, {"one_sided": 1.3, "allreduce": 1.0}, 12)
    assert used[6:] == ["allreduce"] * 6
    assert selector.fallbacks == 1 and "1.30x the allreduce median" in selector.reason
    assert len([r for r in caplog.records if "falling back" in r.getMessage()]) == 1


def test_within_the_ratio_stays_one_sided(monkeypatch):
    monkeypatch.delenv("OSMM_USE_ALLREDUCE", raising=False)
    selector = MethodSelector(window=3, ratio=1.2, exchange=three_ranks)
    run(selector, {"one_sided": 1.15, "allreduce": 1.0}, 20)
    assert selector.method == "one_sided" and selector.fallbacks == 0


def test_a_later_slowdown_of_one_sided_triggers_the_fallback(monkeypatch):
    monkeypatch.delenv("OSMM_USE_ALLREDUCE", raising=False)
    selector = MethodSelector(window=4, exchange=three_ranks)
    run(selector, {"one_sided": 1.0, "allreduce": 1.1}, 8 + 10)
    assert selector.method == "one_sided"
    used = run(selector, {"one_sided": 2.0, "allreduce": 1.1}, 10)
    assert used.count("one_sided") <= 4, "falls back within one window of the slowdown"
    assert selector.method == "allreduce" and selector.fallbacks == 1


def test_environment_forces_allreduce_from_the_start(monkeypatch):
    monkeypatch.setenv("OSMM_USE_ALLREDUCE", "1")
    selector = MethodSelector(window=2, exchange=three_ranks)
    assert run(selector, {"one_sided": 0.1, "allreduce": 9.0}, 6) == ["allreduce"] * 6
    assert "OSMM_USE_ALLREDUCE" in selector.reason and selector.fallbacks == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        MethodSelector(window=0, exchange=three_ranks)
    with pytest.raises(ValueError, match="ratio"):
        MethodSelector(ratio=0.5, exchange=three_ranks)
