"""The MPI progress knob: OSMM_PROGRESS / OSMM_PROGRESS_INTERVAL_US and the native setting.

One process (MPI initialised by mpi4py, no other rank): the environment is parsed with clear
errors, the native setting follows set_progress, and the default is ``off`` (``auto``: a
thread polls only during reduce epochs whose communicator reaches other ranks through the
network; ``thread``: during every reduce epoch). The
collective side, products under every mode, is in tests/mpi/runtime/test_progress.py.
"""

from __future__ import annotations

import pytest

from osmm_jax._src import config
from osmm_jax._src.runtime import native


def test_defaults_are_off_and_continuous_polling(monkeypatch):
    monkeypatch.delenv(config.PROGRESS, raising=False)
    monkeypatch.delenv(config.PROGRESS_INTERVAL_US, raising=False)
    assert config.progress_mode() == "off"
    assert config.progress_interval_us() == 0
    monkeypatch.setenv(config.PROGRESS, " Thread ")
    monkeypatch.setenv(config.PROGRESS_INTERVAL_US, "250")
    assert config.progress_mode() == "thread"
    assert config.progress_interval_us() == 250


@pytest.mark.parametrize("text", ["on", "1", "threads"])
def test_a_bad_mode_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(config.PROGRESS, text)
    with pytest.raises(ValueError, match=config.PROGRESS):
        config.progress_mode()


@pytest.mark.parametrize("text", ["-1", "1.5", "fast"])
def test_a_bad_interval_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(config.PROGRESS_INTERVAL_US, text)
    with pytest.raises(ValueError, match=config.PROGRESS_INTERVAL_US):
        config.progress_interval_us()


def test_set_progress_reaches_the_native_layer():
    before = native.progress_settings()
    try:
        for mode in config.PROGRESS_MODES:
            native.set_progress(mode, 50)
            assert native.progress_settings() == (mode, 50)
        native.set_progress("off")  # keeps the interval
        assert native.progress_settings() == ("off", 50)
        with pytest.raises(ValueError, match="progress"):
            native.set_progress("sometimes")
        with pytest.raises(ValueError, match="interval_us"):
            native.set_progress("thread", -5)
    finally:
        native.set_progress(*before)


def test_stats_count_polls_and_closing_fence_time():
    stats = native.stats()
    assert stats["progress_polls"] >= 0
    assert stats["closing_fence_seconds"] >= 0.0
