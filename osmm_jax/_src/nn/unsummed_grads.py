"""Noticing a data-parallel training step that leaves some gradients un-summed.

In data-parallel training with :mod:`osmm_jax.flax`, the gradients of the data-parallel layers'
parameters (``Dense`` / ``Linear``) arrive summed over ranks by their products; every other
replicated parameter (an embedding, a LayerNorm, a stock layer) gets this rank's gradient
alone until :func:`osmm_jax.flax.sync_grads` sums it. Applying such a gradient trains each
replica on its own rows and the replicas drift apart, silently. This module notices it.

How: a data-parallel layer whose parameters are being differentiated reports it here (:func:
`note_differentiated`), with a function that names the model's parameters outside
data-parallel layers (none: nothing can go wrong). ``sync_grads`` reports that it ran
(:func:`note_synced`). The verdict is given

* for a jitted function, when JAX finishes tracing it (a ``jax.monitoring`` event that JAX
  sends at the end of every outermost trace): if the trace differentiated a data-parallel
  layer of a model with other parameters and never called ``sync_grads``, the program would
  apply un-summed gradients on every step;
* for eager differentiation, at the next data-parallel layer call outside that
  differentiation (the next step), or at exit.

The verdict is one :class:`UnsummedGradientsWarning` per process, naming the parameters.
Python's warning filters make it an error (refuse) or silence it (a user who sums those
gradients some other way). Inside :func:`osmm_jax.flax.value_and_grad`, which sums them
itself, nothing is noted. Costs nothing at run time: everything happens while tracing.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax

from osmm_jax._src import compat


class UnsummedGradientsWarning(UserWarning):
    """A training step differentiates osmm_jax data-parallel layers but leaves the gradients of
    the model's other replicated parameters this rank's alone (no ``sync_grads``)."""


@dataclass
class _Note:
    """One data-parallel layer differentiated in one trace."""

    trace: weakref.ref  # the differentiating trace (JVP / linearize)
    staged: bool  # inside a jit trace: judged when that trace ends
    unsummed: Callable[[], Iterable[str]]  # differentiated parameters outside osmm_jax layers


class _State(threading.local):
    def __init__(self):
        self.notes: list[_Note] = []
        self.models: dict[int, tuple[object, dict]] = {}


_state = _State()
_warned = False
_warned_lock = threading.Lock()
# Set inside osmm_jax.flax.value_and_grad: the callback receives every differentiated
# parameter of a data-parallel layer (the tracer itself), and nothing is noted.
_collecting: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "osmm_jax_collect_summed", default=None
)


def _traces(value):
    """The traces ``value`` is a tracer of, innermost first (none for a concrete value)."""
    yield from _chain(value._trace if isinstance(value, jax.core.Tracer) else None)


def _chain(trace):
    """``trace`` and the traces it was started inside, innermost first."""
    while trace is not None:
        yield trace
        trace = compat.parent_trace(trace)


def _trace_of(value):
    """The innermost trace differentiating ``value``, or None when nothing differentiates it.

    A parameter reached through ``jax.checkpoint`` (``nn.remat``), ``scan`` or a ``jit`` inside
    the differentiated function is a tracer of that inner trace, started inside the
    differentiating one: it counts as differentiated too.
    """
    return next((t for t in _traces(value) if compat.is_differentiation_trace(t)), None)


def _staged(trace) -> bool:
    """Whether ``trace`` runs inside a trace that stages a program out (jit, scan, ...)."""
    return any(compat.is_staging_trace(t) for t in _chain(trace))


@contextlib.contextmanager
def collecting(callback: Callable):
    """Within the block, osmm_jax layers report to ``callback`` instead of noting anything:
    ``callback("data_parallel", param)`` per differentiated parameter of a data-parallel layer
    (or one whose gradient a sequence-parallel layer completes), ``callback("tensor_parallel",
    comm)`` per tensor-parallel layer call and ``callback("sequence_parallel", comm)`` per
    sequence-parallel one."""
    token = _collecting.set(callback)
    try:
        yield
    finally:
        _collecting.reset(token)


def differentiated(params: Iterable) -> list:
    """The values among ``params`` (None allowed) that are being differentiated."""
    return [p for p in params if p is not None and _trace_of(p) is not None]


def note_differentiated(
    params: Iterable, prepare: Callable[[], Callable[[], Iterable[str]]]
) -> None:
    """Called by a data-parallel layer with its parameters (``kernel``, ``bias``: the values it
    received) at every call; does something only when they are being differentiated.

    ``prepare`` is called then, while the layer's call is still on the stack, and returns the
    function that names the model's differentiated parameters outside osmm_jax layers; that
    one is called at most once, when the verdict is given. Inside :func:`collecting`, the
    parameters go to its callback instead, as ``("data_parallel", param)``.
    """
    found = differentiated(params)
    current = _trace_of(found[0]) if found else None
    _judge_eager(keep=current)
    if current is None:
        return
    callback = _collecting.get()
    if callback is not None:
        for p in found:
            callback("data_parallel", p)
        return
    _state.notes.append(_Note(weakref.ref(current), _staged(current), prepare()))


def note_tensor_parallel(dot, kernel, bias) -> tuple:
    """Called by a tensor-parallel layer (linen or nnx) at every call with its product (a
    ``TensorParallelDot``) and its parameters (``bias`` None allowed).

    Inside :func:`collecting`, when they are differentiated, the product's communicator goes
    to the callback: as ``("sequence_parallel", comm)`` with ``batch_sizes`` (the gradients it
    completes are complete over those ranks only), as ``("tensor_parallel", comm)`` without
    (its shards must not be summed over the ranks that share the layer).

    Returns the parameters whose gradients the product completes over its ranks, to be noted
    as a data-parallel layer's (see ``TensorParallelDot.completed_prefix``): with
    ``batch_sizes`` the kernel and a column-parallel bias (the rows were gathered), not a
    row-parallel bias (added to this rank's rows only); none without.
    """
    kind = "sequence_parallel" if dot.sequence_parallel else "tensor_parallel"
    callback = _collecting.get()
    if callback is not None and differentiated((kernel, bias)):
        callback(kind, dot.comm)
    if not dot.sequence_parallel:
        return ()
    return (kernel, bias) if dot.split == "column" else (kernel,)


def derived_from(value, trace) -> bool:
    """Whether ``value`` is a tracer of ``trace`` or of a trace started inside it."""
    return any(t is trace for t in _traces(value))


def model_record(root) -> dict:
    """A dict shared by the osmm_jax layers of one model (``root``) while its differentiation
    is judged: where they record which parameters they cover."""
    entry = _state.models.get(id(root))
    if entry is None or entry[0] is not root:
        entry = (root, {})
        _state.models[id(root)] = entry
    return entry[1]


def known_models() -> list[dict]:
    """The records :func:`model_record` holds now."""
    return [record for _, record in _state.models.values()]


def caller_frames(limit: int = 64):
    """The frames of the calls on the stack, from the osmm_jax layer's caller outwards (at most
    ``limit``): where the model a layer belongs to is found while it is traced. Called from a
    function that looks for the model, itself called from the layer's hook."""
    import sys

    frame = sys._getframe(3)  # 0: here, 1: the finder, 2: the layer's hook, 3: its caller
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def note_synced() -> None:
    """``sync_grads`` ran: the gradients of this thread's pending differentiations are summed."""
    _state.notes.clear()
    _state.models.clear()


def _judge(notes: list[_Note]) -> None:
    """Warn (once per process) if any note's model has differentiated parameters outside
    osmm_jax layers."""
    global _warned
    if not _state.notes and compat.no_trace_active():
        _state.models.clear()
    if not notes or _warned:
        return
    names: list[str] = []
    for note in notes:
        names.extend(n for n in note.unsummed() if n not in names)
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:4]) + (
        f" and {len(names) - 4} more" if len(names) > 4 else ""
    )
    try:
        warnings.warn(
            "osmm_jax.flax: a training step differentiates osmm_jax data-parallel layers, whose "
            "gradients arrive summed over ranks, but the model's other parameters "
            f"({shown}) get this rank's gradient alone and osmm_jax.flax.sync_grads was not "
            "called on them: applying them trains each rank on its own rows and the replicas "
            "drift apart. Use osmm_jax.flax.value_and_grad (or grad), or call sync_grads on the "
            "gradients in the same function. If you sum them another way, silence this with "
            "warnings.filterwarnings('ignore', category=osmm_jax.flax.UnsummedGradientsWarning).",
            UnsummedGradientsWarning,
            stacklevel=_user_stacklevel(),
        )
    except UnsummedGradientsWarning:
        # Refused (an "error" filter). JAX keeps the traced function all the same: drop its
        # caches, so that calling the step again traces it again and is refused again.
        jax.clear_caches()
        raise
    # Latched only once the warning was given: under an "error" filter the raise above refuses
    # the step, and a retried step is refused again.
    with _warned_lock:
        _warned = True


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside osmm_jax, JAX and Flax (the user's line
    that traced or ran the step), for ``warnings.warn`` called from :func:`_judge`."""
    import sys

    frame, level = sys._getframe(2), 2  # 1: _judge's own frame, as warnings.warn counts
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("osmm_jax.", "jax.", "jaxlib.", "flax.", "contextlib")):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _judge_eager(keep=None) -> None:
    """Judge the eager notes whose differentiation is over (any trace other than ``keep``)."""
    notes = _state.notes
    if not notes:
        return
    done = [n for n in notes if not n.staged and n.trace() is not keep]
    if done:
        _state.notes = [n for n in notes if n.staged or n.trace() is keep]
        _judge(done)


def _on_trace_end(event: str, duration: float, **kwargs) -> None:
    """``jax.monitoring`` listener: JAX finished tracing an outermost function."""
    if event != compat.JAXPR_TRACE_EVENT:
        return
    if not _state.notes:
        if _state.models and compat.no_trace_active():
            _state.models.clear()
        return
    staged = [n for n in _state.notes if n.staged]
    if staged:
        _state.notes = [n for n in _state.notes if not n.staged]
        _judge(staged)


def _at_exit() -> None:
    with contextlib.suppress(Exception):
        _judge_eager()


def reset() -> None:
    """Forget this thread's notes and allow the warning again (tests)."""
    global _warned
    _state.notes.clear()
    _state.models.clear()
    _warned = False


jax.monitoring.register_event_duration_secs_listener(_on_trace_end)
atexit.register(_at_exit)
