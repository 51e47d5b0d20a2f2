"""Every JAX and mpi4jax name osmm_jax uses that is not public API, in one place.

osmm_jax admits every jax from :data:`TESTED_JAX`'s first release on (pyproject.toml), but the
names below are not public and may move in any release. Nothing else in osmm_jax imports from
``jax._src`` or ``mpi4jax._src``; every name is resolved here, at import, by :func:`_require`,
so a JAX that moved one fails at ``import osmm_jax`` with one ImportError naming the name and
the releases osmm_jax was tested on, not with an AttributeError deep inside a trace.

Where a public equivalent exists in the JAX running, it is used instead
(``jax.extend.core.Effect``, public from jax 0.10; ``jax.ffi.abstract_token``, from 0.11);
the private name is then only the older releases' fallback. What stays private, and why no
public API serves (tests/test_compat.py checks, on every JAX of the test matrix, that each
still means what osmm_jax assumes):

* the ordered-effect registries (``effects.ordered_effects`` and three more): JAX has no public
  way to declare an effect *ordered*. ``jax.ffi.ffi_call(has_side_effect=True)`` only keeps a
  call from being removed; XLA may still run two such calls concurrently or reorder them,
  while osmm_jax's collectives must run in program order on every rank.
* ``mpi4jax._src.utils.ordered_effect``: with mpi4jax installed, osmm_jax's collectives carry
  mpi4jax's own effect, so that they and mpi4jax's (the allreduce method's baseline, or a
  user's own) share one token chain and are never reordered against each other. mpi4jax
  exports no name for it.
* ``dispatch.RuntimeTokenSet``: :func:`recover_failed_runtime_tokens` (below) lets a rank run
  products again after one of its products failed; JAX offers no hook into its runtime tokens.
* ``dispatch.JAXPR_TRACE_EVENT``, the ``jax.monitoring`` event sent when an outermost trace
  ends, and the trace classes (``ad.JVPTrace``, ``ad.LinearizeTrace``,
  ``partial_eval.DynamicJaxprTrace``, ``core.trace_state_clean``, ``Trace.parent_trace``): the
  unsummed-gradient warning (:mod:`osmm_jax._src.nn.unsummed_grads`) must tell, while tracing,
  whether a parameter is being differentiated inside a jitted step. JAX has no public
  introspection of the trace stack.
* ``custom_batching.custom_vmap_p``, on jax < 0.8.2 only (:func:`_keep_custom_vmap_effects`).

The token of the ordered effect is threaded through the lowering with the lowering context's
``tokens_in`` / ``set_tokens_out`` and ``jax.interpreters.mlir.TokenSet``: public module, but
the part of JAX's lowering API most likely to change, so it lives here too.

Without mpi4jax, osmm_jax registers an ordered effect of its own.
"""

from __future__ import annotations

import importlib
import re
import warnings

import jax
import jax.extend.core
import jax.ffi
from jax.interpreters import mlir

# The jax releases the whole suite has passed on, oldest and newest (BUILD.md, "Tested versions").
TESTED_JAX = ("0.6.2", "0.12.1")
# The mpi4jax releases the same, for the `mpi4jax` extra.
TESTED_MPI4JAX = ("0.9.1.post2", "0.9.1.post2")


def _require(path: str, package: str = "jax", tested: tuple[str, str] = TESTED_JAX):
    """The object at ``path`` ("jax._src.dispatch:RuntimeTokenSet.get_token_input": a module,
    then attributes), or one ImportError that names it, the ``package`` release installed and
    the releases osmm_jax was tested on."""
    module_name, _, attributes = path.partition(":")
    try:
        found = importlib.import_module(module_name)
        for name in attributes.split("."):
            found = getattr(found, name)
        return found
    except (ImportError, AttributeError) as err:
        installed = importlib.import_module(package).__version__
        name = path.replace(":", ".")
        raise ImportError(
            f"osmm_jax needs {name}, which {package} {installed} does not have: osmm_jax is "
            f"tested with {package} {tested[0]} to {tested[1]}. Install one of those "
            f"(pip install '{package}>={tested[0]},<={tested[1]}'), or an osmm_jax release "
            f"that supports {package} {installed}."
        ) from err


_effects_registries = [
    _require(f"jax._src.effects:{name}")
    for name in (
        "ordered_effects",
        "lowerable_effects",
        "control_flow_allowed_effects",
        "custom_derivatives_allowed_effects",
    )
]
_RuntimeTokenSet = _require("jax._src.dispatch:RuntimeTokenSet")
_require("jax._src.dispatch:RuntimeTokenSet.get_token_input")
# The jax.monitoring event JAX records when it finishes tracing an outermost jitted function.
JAXPR_TRACE_EVENT: str = _require("jax._src.dispatch:JAXPR_TRACE_EVENT")
_DIFFERENTIATION_TRACES = (
    _require("jax._src.interpreters.ad:JVPTrace"),
    _require("jax._src.interpreters.ad:LinearizeTrace"),
)
_STAGING_TRACE = _require("jax._src.interpreters.partial_eval:DynamicJaxprTrace")
_trace_state_clean = _require("jax._src.core:trace_state_clean")

abstract_token = getattr(jax.ffi, "abstract_token", None) or _require(
    "jax._src.core:abstract_token"
)
_Effect = getattr(jax.extend.core, "Effect", None) or _require("jax._src.effects:Effect")


def _release(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` as ``(0, 12, 0, 1)`` (a pre-release suffix is dropped)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("rc")[0].split("dev")[0]))


def _import_mpi4jax() -> bool:
    """Import mpi4jax if it is installed; whether it is.

    mpi4jax warns at import when jax is newer than the newest it declares (0.11.2 for mpi4jax
    0.9.1): on every rank, at every start. Within :data:`TESTED_JAX` osmm_jax's suite has run
    mpi4jax on that very jax (BUILD.md, "Tested versions"), so the warning is silenced there;
    above it, it is shown."""
    with warnings.catch_warnings():
        if _release(jax.__version__) <= _release(TESTED_JAX[1]):
            warnings.filterwarnings(
                "ignore", message=r"\s*The latest supported JAX version", category=UserWarning
            )
        try:
            import mpi4jax  # noqa: F401
        except ImportError:
            return False
    return True


HAVE_MPI4JAX = _import_mpi4jax()

if HAVE_MPI4JAX:
    ordered_effect = _require("mpi4jax._src.utils:ordered_effect", "mpi4jax", TESTED_MPI4JAX)
else:

    class OrderedMPIEffect(_Effect):
        """osmm_jax's collectives, in program order (used when mpi4jax is not installed)."""

        def __str__(self) -> str:
            return "OrderedOsmmMPI"

    # Ordered, lowerable, allowed inside control flow and custom_vjp / custom_vmap rules.
    for _registry in _effects_registries:
        _registry.add_type(OrderedMPIEffect)
    ordered_effect = OrderedMPIEffect()


def _keep_custom_vmap_effects() -> None:
    """Make ``jax.custom_batching.custom_vmap`` keep the effects of the function it wraps, as
    it does from jax 0.8.2 on. Before, its abstract evaluation dropped them: a jitted program
    whose only ordered effects sit inside a custom_vmap (every osmm_jax product) got no token
    for them, and lowering failed with a ``KeyError`` on the effect."""
    if jax.__version_info__ >= (0, 8, 2):
        return
    _require("jax._src.custom_batching:custom_vmap_p").def_effectful_abstract_eval(
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
    "TESTED_JAX",
    "TESTED_MPI4JAX",
    "abstract_token",
    "get_token_effect",
    "is_differentiation_trace",
    "is_staging_trace",
    "no_trace_active",
    "parent_trace",
    "ordered_effect",
    "recover_failed_runtime_tokens",
    "set_token_effect",
]


def is_differentiation_trace(trace) -> bool:
    """Whether ``trace`` is one of reverse- or forward-mode differentiation (jax.grad, jax.vjp,
    jax.jvp, jax.linearize)."""
    return isinstance(trace, _DIFFERENTIATION_TRACES)


def parent_trace(trace):
    """The trace ``trace`` was started inside (None for the outermost)."""
    return getattr(trace, "parent_trace", None)


def is_staging_trace(trace) -> bool:
    """Whether ``trace`` stages a program out (jax.jit and the control-flow primitives)."""
    return isinstance(trace, _STAGING_TRACE)


def no_trace_active() -> bool:
    """Whether this thread is outside every JAX trace (no jit, grad, vmap... is tracing)."""
    return _trace_state_clean()


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
    original = _RuntimeTokenSet.get_token_input
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
    _RuntimeTokenSet.get_token_input = get_token_input
