"""Logging for osmm_jax: one logger hierarchy, messages prefixed with the MPI rank.

Every module logs through :func:`get_logger`, under the ``osmm_jax`` logger. Under
``mpiexec`` several ranks write to one terminal, so every message starts with the
rank that wrote it (``[rank 2/3] profiling GEMM rate: ...``), whichever handler
prints it: the user's (``logging.basicConfig``) or the one :func:`enable_logging`
adds.

Quiet by default, as a library should be: the package logger has only a
NullHandler, so nothing is printed until the application configures logging.

The rank is found lazily, per message: from mpi4py's COMM_WORLD if mpi4py has
already initialised MPI, else from the launcher's environment (``PMI_RANK`` from
MPICH/Hydra, ``OMPI_COMM_WORLD_RANK`` from Open MPI), else it is left out. This
module never imports mpi4py or JAX itself.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "osmm_jax"
"""The name of the package logger; every osmm_jax logger is below it."""

FORMAT = "%(rank_prefix)s%(levelname)s %(name)s: %(message)s"
"""The format of the handler :func:`enable_logging` adds (the rank comes first)."""

_ENV_RANKS = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def rank_prefix() -> str:
    """``"[rank R/N] "`` for this process (``"[rank R] "`` if the size is unknown), or ``""``."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                world = mpi.COMM_WORLD
                return f"[rank {world.Get_rank()}/{world.Get_size()}] "
        except Exception:  # noqa: BLE001 - a log line must never raise
            pass
    for rank_var, size_var in _ENV_RANKS:
        rank = os.environ.get(rank_var, "").strip()
        if rank.isdigit():
            size = os.environ.get(size_var, "").strip()
            return f"[rank {rank}/{size}] " if size.isdigit() else f"[rank {rank}] "
    return ""


class _RankFilter(logging.Filter):
    """Prefixes each record's message with the rank (once) and stores it as ``rank_prefix``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank_prefix"):
            prefix = rank_prefix()
            record.rank_prefix = prefix
            if prefix:
                record.msg = prefix + str(record.msg)
        return True


class _RankFormatter(logging.Formatter):
    """Formats with :data:`FORMAT`, moving the rank from the message to the front of the line."""

    def __init__(self) -> None:
        super().__init__(FORMAT, defaults={"rank_prefix": ""})

    def formatMessage(self, record: logging.LogRecord) -> str:
        prefix = getattr(record, "rank_prefix", "")
        if prefix and record.message.startswith(prefix):
            record.message = record.message[len(prefix) :]
        return super().formatMessage(record)


_FILTER = _RankFilter()
_package = logging.getLogger(ROOT)
if not any(isinstance(h, logging.NullHandler) for h in _package.handlers):
    _package.addHandler(logging.NullHandler())


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` under the ``osmm_jax`` hierarchy, with the rank prefix attached.

    ``name`` may be a module's ``__name__`` (``"osmm_jax._src.tuning.speeds"`` gives
    ``"osmm_jax.speeds"``) or a short name (``"speeds"``).
    """
    short = name.rsplit(".", 1)[-1] if name.startswith(ROOT + ".") else name
    full = ROOT if short in ("", ROOT) else f"{ROOT}.{short}"
    logger = logging.getLogger(full)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


def enable_logging(level: int | str = logging.INFO) -> logging.Logger:
    """Print osmm_jax's log messages of ``level`` and above to stderr, prefixed with the rank.

    Adds one stderr handler to the ``osmm_jax`` logger (calling again only changes
    the level; it never adds a second handler) and returns that logger. Messages
    still propagate to the root logger: an application that also calls
    ``logging.basicConfig`` sees them twice and should use one or the other.

    Args:
        level: a ``logging`` level, as a number or a name (``"DEBUG"``, ``"INFO"``, ...).
    """
    if isinstance(level, str):
        name = level.strip().upper()
        level = logging.getLevelName(name)
        if not isinstance(level, int):
            raise ValueError(f"unknown logging level {name!r}")
    package = logging.getLogger(ROOT)
    handler = next((h for h in package.handlers if getattr(h, "_osmm_stderr", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_RankFormatter())
        handler._osmm_stderr = True
        package.addHandler(handler)
    handler.setLevel(level)
    package.setLevel(level)
    return package
