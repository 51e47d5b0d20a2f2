"""The watchdog's settings, and the Python side of its bound on blocking steps.

The native layer bounds every blocking MPI step it takes (xla_ffi/watchdog/watchdog.h): when a step
exceeds the timeout, the rank prints a report of where every rank of the communicator is
(read through a side channel, not the stuck collective) and ends the job with
``MPI_Abort(MPI_COMM_WORLD, 75)``, or, in ``raise`` mode, the step fails with that report
where it can be bounded without ending the job. This module sets the timeout and the mode
(``OSMM_TIMEOUT``, ``OSMM_ON_TIMEOUT``, or :func:`timeout` for a block of code) and watches
matmul's own collective checks the same way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from osmm_jax._src import config
from osmm_jax._src.runtime import native

_lock = threading.Lock()
_overrides: list[tuple[float, str]] = []  # innermost last
_applied: tuple[float, str] | None = None
_hook_decided = False  # install_failure_hook ran (the setting is read once)
_REASON_CHARS = 200  # the native notice holds 247 bytes
_FAILED_RANK_GRACE_S = 1.5  # how long a failed rank lets the others end the job first


class WatchdogTimeout(TimeoutError):
    """A blocking step of osmm_jax exceeded the watchdog's timeout (``raise`` mode).

    The message reports where every rank of the communicator was. The communicator must not
    be used again: a collective is left pending on it. End the job and start it again.
    """


def _apply(settings: tuple[float, str]) -> None:
    global _applied
    if settings != _applied:
        native.set_watchdog(settings[0], settings[1] == "raise")
        _applied = settings


def settings() -> tuple[float, str]:
    """The ``(timeout in seconds, "abort" or "raise")`` in force: the innermost :func:`timeout`
    block, else ``OSMM_TIMEOUT`` and ``OSMM_ON_TIMEOUT`` (ValueError if they are garbage)."""
    with _lock:
        if _overrides:
            return _overrides[-1]
    return config.timeout_seconds(), config.on_timeout()


def apply_settings() -> tuple[float, str]:
    """Hand :func:`settings` to the native watchdog (cheap when unchanged); returns them. Also
    installs the hook that reports this rank's uncaught exceptions (see
    :func:`install_failure_hook`)."""
    current = settings()
    with _lock:
        _apply(current)
    install_failure_hook()
    return current


def report_failure(reason: str) -> None:
    """Tell the other ranks that this rank failed for ``reason`` (once per process): those
    waiting for it in a product end the job with that reason, this rank too if it then waits
    in a step (at exit), instead of waiting out the timeout."""
    unreached = native.report_failure(reason[:_REASON_CHARS])
    if unreached:
        sys.stderr.write(unreached)


def _failure_hook(previous):
    def hook(exc_type, exc, tb):
        try:
            report_failure(f"{exc_type.__name__}: {exc}".splitlines()[0])
        finally:
            previous(exc_type, exc, tb)
        # Exiting would free the windows collectively while the others are inside a product.
        sys.stdout.flush()
        sys.stderr.flush()
        native.end_job_after_failure(_FAILED_RANK_GRACE_S)

    hook.osmm_previous = previous
    return hook


def install_failure_hook() -> None:
    """Wrap ``sys.excepthook`` (once per process, unless ``OSMM_REPORT_FAILURES=0``) so that an
    uncaught exception on this rank is reported to the other ranks, then handled by the
    previous hook. Called on every product: after the first call it only reads a flag."""
    global _hook_decided
    if _hook_decided:
        return
    report = config.report_failures()  # a bad value raises here, on every product until fixed
    _hook_decided = True
    if report and getattr(sys.excepthook, "osmm_previous", None) is None:
        sys.excepthook = _failure_hook(sys.excepthook)


@contextlib.contextmanager
def timeout(seconds: float, on_timeout: str | None = None):
    """Within this block, a blocking step of osmm_jax may take ``seconds`` (0: no limit), and
    ``on_timeout`` (``"abort"`` or ``"raise"``; default: ``OSMM_ON_TIMEOUT``) says what
    happens when one takes longer. Process-wide (products running on other threads are
    bounded the same way); blocks nest.

    Example, in a notebook: ``with osmm_jax.timeout(60, "raise"): c = step(a, b)``.
    """
    seconds = config.check_timeout(seconds)
    mode = config.on_timeout() if on_timeout is None else config.check_on_timeout(on_timeout)
    with _lock:
        _overrides.append((seconds, mode))
        _apply(_overrides[-1])
    try:
        yield
    finally:
        with _lock:
            _overrides.pop()
            restored = _overrides[-1] if _overrides else None
        _apply(restored if restored is not None else settings())


@contextlib.contextmanager
def host_step(comm, what: str):
    """Watch a collective that osmm_jax runs from Python on ``comm`` (an mpi4py communicator
    of ours): under the timeout like the native steps. In ``raise`` mode every rank first
    meets in a barrier that is waited for with a deadline, so that a rank the others wait for
    in vain raises :class:`WatchdogTimeout` instead of hanging."""
    seconds, raise_error = native.watchdog_settings()  # as applied: never raises here
    handle = native.comm_attribute(comm.handle)
    native.begin_host_step(handle)
    try:
        if raise_error and seconds > 0 and comm.Get_size() > 1:
            _bounded_barrier(comm, handle, what, seconds)
        yield
    finally:
        native.end_host_step()


def _bounded_barrier(comm, handle: int, what: str, seconds: float) -> None:
    request = comm.Ibarrier()
    start = time.monotonic()
    pause = 1e-5
    while not request.Test():
        waited = time.monotonic() - start
        failed = native.failure_report(handle)
        if failed:
            raise WatchdogTimeout(
                failed + "This communicator has a collective pending: end the job."
            )
        if waited > seconds:
            report = native.describe_ranks(
                handle,
                f"osmm_jax watchdog: rank {comm.Get_rank()} has waited {waited:.1f} s "
                f"(limit {seconds:g} s) for the other ranks in {what}. Every rank of the "
                "communicator:",
            )
            raise WatchdogTimeout(
                report + "This communicator has a collective pending: end the job and start "
                "it again."
            )
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
