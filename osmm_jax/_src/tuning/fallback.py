"""Automatic fallback from the one-sided method to the all-reduce baseline.

One-sided RMA is the faster path on the machines osmm_jax targets, but an MPI
whose RMA is emulated in software, or a network without RDMA, can make it
slower than a tuned all-reduce. :class:`MethodSelector` measures both inside the
user's own training loop and keeps whichever is faster:

1. probing: the first ``2 * window`` steps alternate ``one_sided`` and
   ``allreduce`` (A B A B, so drift on a shared machine hits both alike);
2. then it runs ``one_sided`` unless its median step time exceeds ``ratio``
   (1.2) times the all-reduce median; while on ``one_sided`` it keeps a sliding
   window of its times and falls back as soon as that median crosses the
   threshold. A fallback is final, and logged once, with the numbers.

Step times are exchanged (the slowest rank's time counts), so every rank takes
the same decision at the same step. ``OSMM_USE_ALLREDUCE=1`` forces
``allreduce`` from the start and disables probing.

Typical loop::

    selector = osmm_jax.MethodSelector()
    step_fns = {m: jax.jit(functools.partial(train_step, method=m)) for m in osmm_jax.METHODS}
    for batch in data:
        start = time.perf_counter()
        state = jax.block_until_ready(step_fns[selector.method](state, batch))
        selector.observe(time.perf_counter() - start)
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence

from osmm_jax._src import checks, config
from osmm_jax._src.log import get_logger
from osmm_jax._src.runtime import metrics

logger = get_logger(__name__)


class MethodSelector:
    """Chooses ``method`` for each step from measured step times (see the module docstring).

    Args:
        window: steps per method in the probing phase, and the length of the
            sliding window watched afterwards.
        ratio: fall back when median(one_sided) > ratio * median(allreduce).
        comm: mpi4py communicator whose ranks exchange step times (default
            COMM_WORLD, through osmm_jax's private duplicate).
        exchange: instead of ``comm``, a function mapping this rank's time to
            every rank's times (for use without MPI, e.g. in tests).

    Attributes:
        method: the method the next step should use.
        fallbacks: 1 once the selector has fallen back, else 0.
        reason: why the current method was chosen (human-readable).
    """

    def __init__(
        self,
        *,
        window: int = 10,
        ratio: float = 1.2,
        comm=None,
        exchange: Callable[[float], Sequence[float]] | None = None,
    ):
        self.window = checks.integer(window, "window", 1)
        self.ratio = checks.at_least(ratio, "ratio", 1.0, allow_inf=True)
        self._exchange = exchange if exchange is not None else _mpi_exchange(comm)
        self._probe = {m: [] for m in config.METHODS}
        self._recent: deque[float] = deque(maxlen=self.window)
        self.fallbacks = 0
        if config.default_method() == "allreduce":
            self.method, self._decided = "allreduce", True
            self.reason = f"{config.USE_ALLREDUCE}=1 forces the allreduce method"
        else:
            self.method, self._decided = "one_sided", False
            self.reason = "probing one_sided against allreduce"

    def observe(self, step_seconds: float) -> str:
        """Record this rank's time for the step just run with :attr:`method`.

        Collective when ranks exchange over MPI: every rank must call it once per
        step. Returns the method for the next step.
        """
        metrics.observe_step(float(step_seconds))
        slowest = max(float(t) for t in self._exchange(float(step_seconds)))
        if self._decided:
            if self.method == "one_sided":
                self._recent.append(slowest)
                if len(self._recent) == self.window:
                    self._maybe_fall_back(statistics.median(self._recent), "the last")
            return self.method
        self._probe[self.method].append(slowest)
        if all(len(times) >= self.window for times in self._probe.values()):
            self._decided = True
            self.method = "one_sided"
            self.reason = "one_sided was not slower than allreduce by more than the ratio"
            self._maybe_fall_back(statistics.median(self._probe["one_sided"]), "probe")
        else:
            self.method = "allreduce" if self.method == "one_sided" else "one_sided"
        return self.method

    @property
    def allreduce_median(self) -> float | None:
        times = self._probe["allreduce"]
        return statistics.median(times) if times else None

    def _maybe_fall_back(self, one_sided_median: float, which: str) -> None:
        baseline = self.allreduce_median
        if baseline is None or one_sided_median <= self.ratio * baseline:
            return
        self.method = "allreduce"
        self.fallbacks = 1
        metrics.increment("fallbacks")
        self.reason = (
            f"one_sided median step {one_sided_median * 1e3:.2f} ms over {which} {self.window} "
            f"steps is {one_sided_median / baseline:.2f}x the allreduce median "
            f"{baseline * 1e3:.2f} ms (threshold {self.ratio:.2f}x): falling back to allreduce"
        )
        logger.warning("osmm_jax: %s", self.reason)


def _mpi_exchange(comm) -> Callable[[float], Sequence[float]]:
    from osmm_jax._src.runtime import communicators

    private = communicators.private_comm(comm)
    return private.allgather
