"""Every private JAX and mpi4jax name osmm_jax uses, in one place.

osmm_jax pins ``jax`` and ``mpi4jax`` to version ranges (pyproject.toml), but the names below
are not public API and may move between releases. When one does, this module is the only
place to change. Nothing else in osmm_jax imports from ``jax._src`` or ``mpi4jax._src``.

The ordered effect: osmm_jax's collectives carry one ordered effect, so that XLA runs them in
program order on every rank. When mpi4jax is installed it is mpi4jax's own effect, so that
osmm_jax's calls and mpi4jax's (the allreduce method's baseline, or a user's own) share one
token chain and can never be reordered against each other. Without mpi4jax, osmm_jax registers
an ordered effect of its own.
"""

from __future__ import annotations

import jax
from jax._src import core, dispatch, effects
from jax._src.dispatch import apply_primitive
from jax._src.interpreters import ad, mlir, partial_eval
from jax._src.lib import xla_client

try:
    from mpi4jax._src.utils import ordered_effect

    HAVE_MPI4JAX = True
except ImportError:
    HAVE_MPI4JAX = False

    class OrderedMPIEffect(effects.Effect):
        """osmm_jax's collectives, in program order (used when mpi4jax is not installed)."""

        def __str__(self) -> str:
            return "OrderedOsmmMPI"

    # Ordered, lowerable, allowed inside control flow and custom_vjp / custom_vmap rules.
    for _registry in (
        effects.ordered_effects,
        effects.lowerable_effects,
        effects.control_flow_allowed_effects,
        effects.custom_derivatives_allowed_effects,
    ):
        _registry.add_type(OrderedMPIEffect)
    ordered_effect = OrderedMPIEffect()

abstract_token = core.abstract_token


def _keep_custom_vmap_effects() -> None:
    """Make ``jax.custom_batching.custom_vmap`` keep the effects of the function it wraps, as
    it does from jax 0.8.2 on. Before, its abstract evaluation dropped them: a jitted program
    whose only ordered effects sit inside a custom_vmap (every osmm_jax product) got no token
    for them, and lowering failed with a ``KeyError`` on the effect."""
    if jax.__version_info__ >= (0, 8, 2):
        return
    from jax._src import custom_batching

    custom_batching.custom_vmap_p.def_effectful_abstract_eval(
        lambda *in_avals, call, **_: (call.out_avals, call.effects)
    )


_keep_custom_vmap_effects()


def get_token_effect(ctx, effect):
    """The token of ``effect`` entering the lowering ``ctx``."""
    return ctx.tokens_in.get(effect)


def set_token_effect(ctx, effect, token) -> None:
    """Make ``token`` the token of ``effect`` leaving the lowering ``ctx``."""
    ctx.set_tokens_out(mlir.TokenSet({effect: token}))


__all__ = [
    "HAVE_MPI4JAX",
    "JAXPR_TRACE_EVENT",
    "abstract_token",
    "apply_primitive",
    "get_token_effect",
    "is_differentiation_trace",
    "is_staging_trace",
    "no_trace_active",
    "parent_trace",
    "ordered_effect",
    "recover_failed_runtime_tokens",
    "registered_ffi_targets",
    "set_token_effect",
]


# The jax.monitoring event JAX records when it finishes tracing an outermost jitted function.
JAXPR_TRACE_EVENT: str = dispatch.JAXPR_TRACE_EVENT


def is_differentiation_trace(trace) -> bool:
    """Whether ``trace`` is one of reverse- or forward-mode differentiation (jax.grad, jax.vjp,
    jax.jvp, jax.linearize)."""
    return isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace))


def parent_trace(trace):
    """The trace ``trace`` was started inside (None for the outermost)."""
    return getattr(trace, "parent_trace", None)


def is_staging_trace(trace) -> bool:
    """Whether ``trace`` stages a program out (jax.jit and the control-flow primitives)."""
    return isinstance(trace, partial_eval.DynamicJaxprTrace)


def no_trace_active() -> bool:
    """Whether this thread is outside every JAX trace (no jit, grad, vmap... is tracing)."""
    return core.trace_state_clean()


def registered_ffi_targets(xla_platform: str) -> set[str]:
    """Names of the custom-call targets registered for ``xla_platform`` ("Host", "CUDA").

    Both kinds count: targets XLA already holds (its backend for that platform is loaded) and
    targets ``jax.ffi.register_ffi_target`` queued for a backend that is not loaded (yet), such
    as CUDA targets in a process without a GPU plugin.
    """
    names: set[str] = set()
    with xla_client._custom_callback_lock:
        pending = list(xla_client._custom_callback.get(xla_platform, ()))
        loaded = xla_platform in xla_client._custom_callback_handler
    names.update(entry[0] for entry in pending)
    if loaded:
        names.update(xla_client.custom_call_targets(xla_platform))
    return names


def _failed(token) -> bool:
    """Whether ``token`` (a ``jax.core.Token``) is the output of a computation that failed.
    Never waits: a token whose computation is still running has not failed (yet)."""
    buf = getattr(token, "_buf", None)
    if buf is None or not hasattr(buf, "is_ready"):
        return False
    try:
        if not buf.is_ready():
            return False
        buf.block_until_ready()  # ready: returns at once, or raises the computation's error
    except Exception:  # noqa: BLE001 - any error of the computation that produced it
        return True
    return False


def recover_failed_runtime_tokens(effect) -> None:
    """Make JAX start a fresh token chain for ``effect`` after a computation that failed.

    JAX threads one runtime token per ordered effect from each computation into the next. When
    a computation fails, its output token carries the error, and every later computation with
    that effect fails at once with the same error, on this process only: a rank whose product
    failed (and whose error was caught) could never run another, while the other ranks wait
    for it. This wraps ``RuntimeTokenSet.get_token_input`` so that a failed token of ``effect``
    is replaced by a fresh one. The failed computation is over, so no ordering is lost. The
    check costs one ``is_ready()`` per dispatch of a computation with ``effect``.
    """
    token_set = dispatch.RuntimeTokenSet
    original = token_set.get_token_input
    if getattr(original, "_osmm_recovers", None) is not None:
        original._osmm_recovers.add(effect)
        return

    def get_token_input(self, eff, devices):
        if eff in get_token_input._osmm_recovers:
            current = self.current_tokens.get(eff)
            if current is not None and _failed(current):
                del self.current_tokens[eff]
                for device, token in list(self.output_runtime_tokens.items()):
                    if _failed(token):
                        del self.output_runtime_tokens[device]
        return original(self, eff, devices)

    get_token_input._osmm_recovers = {effect}
    token_set.get_token_input = get_token_input
