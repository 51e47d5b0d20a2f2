"""The watchdog's settings: OSMM_TIMEOUT / OSMM_ON_TIMEOUT, osmm_jax.timeout blocks, and what
reaches the native watchdog. (How a job that falls out of step ends: test_out_of_step.py.)"""

from __future__ import annotations

import sys

import pytest

import osmm_jax as om
from osmm_jax._src import config
from osmm_jax._src.runtime import native, watchdog


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    monkeypatch.delenv(config.TIMEOUT, raising=False)
    monkeypatch.delenv(config.ON_TIMEOUT, raising=False)
    yield
    monkeypatch.delenv(config.TIMEOUT, raising=False)
    monkeypatch.delenv(config.ON_TIMEOUT, raising=False)
    watchdog.apply_settings()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("", 300.0),
        ("  ", 300.0),
        ("12", 12.0),
        ("0.5", 0.5),
        ("0", 0.0),
        ("off", 0.0),
        ("OFF", 0.0),
    ],
)
def test_timeout_variable(monkeypatch, text, seconds):
    monkeypatch.setenv(config.TIMEOUT, text)
    assert config.timeout_seconds() == seconds


@pytest.mark.parametrize("text", ["5min", "-1", "nan", "inf", "true", "1e999"])
def test_garbage_timeout_variable_is_an_error_naming_it(monkeypatch, text):
    monkeypatch.setenv(config.TIMEOUT, text)
    with pytest.raises(ValueError, match=rf"OSMM_TIMEOUT must be .*{text!r}|OSMM_TIMEOUT must"):
        config.timeout_seconds()


@pytest.mark.parametrize(("text", "mode"), [("", "abort"), ("abort", "abort"), ("RAISE", "raise")])
def test_on_timeout_variable(monkeypatch, text, mode):
    monkeypatch.setenv(config.ON_TIMEOUT, text)
    assert config.on_timeout() == mode


def test_garbage_on_timeout_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(config.ON_TIMEOUT, "retry")
    with pytest.raises(ValueError, match="OSMM_ON_TIMEOUT must be one of"):
        config.on_timeout()


def test_the_environment_reaches_the_native_watchdog(monkeypatch):
    monkeypatch.setenv(config.TIMEOUT, "42")
    monkeypatch.setenv(config.ON_TIMEOUT, "raise")
    assert watchdog.apply_settings() == (42.0, "raise")
    assert native.watchdog_settings() == (42.0, True)


def test_timeout_blocks_nest_and_restore(monkeypatch):
    monkeypatch.setenv(config.TIMEOUT, "100")
    watchdog.apply_settings()
    with om.timeout(7, "raise"):
        assert native.watchdog_settings() == (7.0, True)
        with om.timeout(0):  # no limit; the mode comes from OSMM_ON_TIMEOUT (abort)
            assert native.watchdog_settings() == (0.0, False)
            assert watchdog.settings() == (0.0, "abort")
        assert native.watchdog_settings() == (7.0, True)
    assert native.watchdog_settings() == (100.0, False)


def test_timeout_block_is_restored_after_an_error():
    with pytest.raises(RuntimeError, match="inside"):
        with om.timeout(3, "raise"):
            raise RuntimeError("inside")
    assert native.watchdog_settings() == (300.0, False)


@pytest.mark.parametrize(
    ("seconds", "mode", "error"),
    [
        (-1, None, ValueError),
        (float("nan"), None, ValueError),
        ("10", None, TypeError),
        (True, None, TypeError),
        (10, "retry", ValueError),
    ],
)
def test_bad_timeout_arguments_are_refused(seconds, mode, error):
    with pytest.raises(error):
        with om.timeout(seconds, mode):
            pass
    assert native.watchdog_settings() == (300.0, False)


def test_watchdog_timeout_is_a_timeout_error():
    assert issubclass(om.WatchdogTimeout, TimeoutError)
    assert native.WATCHDOG_EXIT_CODE == 75


def test_a_rank_alone_describes_itself():
    from mpi4py import MPI

    from osmm_jax._src.runtime import communicators

    comm = communicators.private_comm(MPI.COMM_SELF)
    report = native.describe_ranks(comm.handle, "headline")
    assert report.startswith("headline\n  rank 0 (this rank): ")


@pytest.mark.parametrize(
    ("text", "report"), [("", True), ("1", True), ("yes", True), ("0", False), ("off", False)]
)
def test_report_failures_variable(monkeypatch, text, report):
    monkeypatch.setenv(config.REPORT_FAILURES, text)
    assert config.report_failures() is report


def test_garbage_report_failures_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv(config.REPORT_FAILURES, "maybe")
    with pytest.raises(ValueError, match=config.REPORT_FAILURES):
        config.report_failures()


def test_the_failure_hook_wraps_the_previous_one_once(monkeypatch):
    seen = []
    previous = lambda *exc_info: seen.append(exc_info[0])  # noqa: E731
    monkeypatch.setattr("sys.excepthook", previous)
    monkeypatch.setattr(watchdog, "_hook_decided", False)
    watchdog.install_failure_hook()
    watchdog.install_failure_hook()
    assert sys.excepthook.osmm_previous is previous
    # A rank alone: the report reaches nobody, and the job is not ended; the previous hook runs.
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    assert seen == [RuntimeError]


def test_the_failure_hook_can_be_turned_off(monkeypatch):
    previous = lambda *exc_info: None  # noqa: E731
    monkeypatch.setattr("sys.excepthook", previous)
    monkeypatch.setenv(config.REPORT_FAILURES, "0")
    monkeypatch.setattr(watchdog, "_hook_decided", False)
    watchdog.install_failure_hook()
    assert sys.excepthook is previous
