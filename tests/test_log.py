"""The rank-prefixed, quiet-by-default logger."""

from __future__ import annotations

import logging
import sys

import pytest

from osmm_jax._src import log as log_mod

# -- the logger -----------------------------------------------------------------------


class _FakeComm:
    def Get_rank(self):
        return 2

    def Get_size(self):
        return 3


class _FakeMPI:
    COMM_WORLD = _FakeComm()

    @staticmethod
    def Is_initialized():
        return True

    @staticmethod
    def Is_finalized():
        return False


def _message(caplog, logger, text="profiling"):
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="osmm_jax"):
        logger.info(text + " %s", "x")
    (record,) = [r for r in caplog.records if r.name == logger.name]
    return record.getMessage()


def test_logger_prefixes_the_rank(monkeypatch, caplog):
    logger = log_mod.get_logger("osmm_jax._src.tuning.speeds")
    assert logger.name == "osmm_jax.speeds"
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    assert _message(caplog, logger) == "profiling x"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert _message(caplog, logger) == "[rank 1] profiling x"
    monkeypatch.setenv("PMI_RANK", "2")
    monkeypatch.setenv("PMI_SIZE", "4")
    assert _message(caplog, logger) == "[rank 2/4] profiling x"
    # Once mpi4py has initialised MPI, COMM_WORLD is asked instead of the environment.
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _FakeMPI)
    assert _message(caplog, logger) == "[rank 2/3] profiling x"


def test_logging_is_quiet_by_default_and_enable_logging_is_idempotent(monkeypatch, capsys):
    package = logging.getLogger("osmm_jax")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)
    before = list(package.handlers)
    level = package.level
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _FakeMPI)
    try:
        log_mod.enable_logging("DEBUG")
        log_mod.enable_logging(logging.INFO)
        added = [h for h in package.handlers if h not in before]
        assert len(added) == 1 and added[0].level == logging.INFO
        record = logging.LogRecord("osmm_jax.speeds", logging.INFO, __file__, 1, "hi", (), None)
        log_mod._FILTER.filter(record)
        line = added[0].format(record)
        assert line == "[rank 2/3] INFO osmm_jax.speeds: hi"
        with pytest.raises(ValueError, match="unknown logging level 'LOUD'"):
            log_mod.enable_logging("loud")
    finally:
        for h in package.handlers[:]:
            if h not in before:
                package.removeHandler(h)
        package.setLevel(level)
