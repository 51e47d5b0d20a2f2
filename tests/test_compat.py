"""The private JAX and mpi4jax names of osmm_jax/_src/compat.py still mean what osmm_jax assumes.

Run on every JAX of the test matrix: a release that keeps a name but changes what it does fails
here, by name, rather than somewhere inside a product.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.extend.core import Primitive  # noqa: E402
from jax.interpreters import mlir  # noqa: E402

from osmm_jax._src import compat  # noqa: E402

# A primitive that carries osmm_jax's ordered effect and lowers to nothing but the token's
# passage: the smallest thing that uses the effect machinery as the real primitives do.
_probe_p = Primitive("osmm_compat_probe")
_probe_p.def_effectful_abstract_eval(lambda x: (x, {compat.ordered_effect}))


def _probe_lowering(ctx, x):
    compat.set_token_effect(
        ctx, compat.ordered_effect, compat.get_token_effect(ctx, compat.ordered_effect)
    )
    return [x]


mlir.register_lowering(_probe_p, _probe_lowering)


def test_the_ordered_effect_is_ordered_lowerable_and_allowed_in_control_flow_and_rules():
    from jax._src import effects

    for registry in (
        effects.ordered_effects,
        effects.lowerable_effects,
        effects.control_flow_allowed_effects,
        effects.custom_derivatives_allowed_effects,
    ):
        assert registry.contains(compat.ordered_effect)


def test_a_jitted_program_with_the_effect_threads_a_runtime_token_in_and_out():
    def f(x):
        return _probe_p.bind(_probe_p.bind(x) + 1.0)

    jaxpr = jax.make_jaxpr(f)(1.0)
    assert compat.ordered_effect in jaxpr.effects
    text = jax.jit(f).lower(1.0).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    # The ordered effect's token is the program's first argument and first result.
    assert main.count("!stablehlo.token") == 2, main
    assert float(jax.jit(f)(1.0)) == 2.0


def test_the_runtime_token_set_holds_the_effect_token_after_a_run():
    """recover_failed_runtime_tokens reads current_tokens and output_runtime_tokens and wraps
    get_token_input(self, effect, devices)."""
    import inspect

    from jax._src import dispatch

    jax.jit(lambda x: _probe_p.bind(x))(jnp.ones(2)).block_until_ready()
    tokens = dispatch.runtime_tokens
    assert isinstance(tokens, dispatch.RuntimeTokenSet)
    assert compat.ordered_effect in tokens.current_tokens
    assert isinstance(tokens.output_runtime_tokens, dict)
    parameters = list(inspect.signature(dispatch.RuntimeTokenSet.get_token_input).parameters)
    assert parameters[:3] == ["self", "eff", "devices"]
    assert not compat._failed(tokens.current_tokens[compat.ordered_effect])


def test_custom_vmap_keeps_the_effect_under_jit():
    """Every osmm_jax product binds its primitives inside a custom_vmap (compat bridges
    jax < 0.8.2, which dropped the effects there)."""

    @jax.custom_batching.custom_vmap
    def g(x):
        return _probe_p.bind(x)

    @g.def_vmap
    def _(axis_size, in_batched, x):
        return _probe_p.bind(x), in_batched[0]

    assert compat.ordered_effect in jax.make_jaxpr(g)(1.0).effects
    assert float(jax.jit(g)(3.0)) == 3.0
    np.testing.assert_array_equal(jax.jit(jax.vmap(g))(jnp.arange(3.0)), [0.0, 1.0, 2.0])


def _unregister_duration_listener(listener):
    unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
    if unregister is None:  # public from jax 0.7
        from jax._src import monitoring

        unregister = monitoring._unregister_event_duration_listener_by_callback
    unregister(listener)


def test_the_trace_event_is_sent_when_an_outermost_trace_ends():
    seen = []

    def listener(event, duration, **kwargs):
        seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 2.0 + 1.0).lower(np.float32(1.0))
    finally:
        _unregister_duration_listener(listener)
    assert compat.JAXPR_TRACE_EVENT in seen


def test_trace_classes_tell_differentiation_staging_and_no_trace():
    assert compat.no_trace_active()
    found = {}

    def f(x):
        trace = x._trace
        found["differentiated"] = compat.is_differentiation_trace(trace)
        chain = []
        while trace is not None:
            chain.append(trace)
            trace = compat.parent_trace(trace)
        found["staged"] = any(compat.is_staging_trace(t) for t in chain)
        found["active"] = not compat.no_trace_active()
        return x * x

    jax.grad(f)(1.0)
    assert found == {"differentiated": True, "staged": False, "active": True}
    jax.jit(jax.grad(f))(1.0)
    assert found == {"differentiated": True, "staged": True, "active": True}
    jax.jit(f)(1.0)
    assert found == {"differentiated": False, "staged": True, "active": True}
    assert compat.no_trace_active()


def test_the_abstract_token_is_jaxs_token_type():
    assert type(compat.abstract_token).__name__ == "AbstractToken"


@pytest.mark.skipif(not compat.HAVE_MPI4JAX, reason="mpi4jax is not installed")
def test_osmm_jax_shares_mpi4jaxs_ordered_effect():
    import mpi4jax
    from mpi4py import MPI

    jaxpr = jax.make_jaxpr(lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=MPI.COMM_SELF))(1.0)
    assert compat.ordered_effect in jaxpr.effects


def test_a_moved_name_fails_with_one_import_error_naming_the_tested_range():
    message = (
        f"osmm_jax needs jax._src.dispatch.no_such_name, which jax {jax.__version__} does "
        f"not have: osmm_jax is tested with jax {compat.TESTED_JAX[0]} to "
        f"{compat.TESTED_JAX[1]}"
    )
    with pytest.raises(ImportError, match=re.escape(message)):
        compat._require("jax._src.dispatch:no_such_name")
    with pytest.raises(ImportError, match="jax._src.no_such_module.name"):
        compat._require("jax._src.no_such_module:name")


def test_the_tested_range_is_the_pins_and_the_build_documents():
    """pyproject.toml admits jax from the oldest tested release on; BUILD.md names both ends."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    oldest, newest = compat.TESTED_JAX
    assert f'"jax>={oldest}",' in pyproject and f'"jaxlib>={oldest}",' in pyproject
    build = (root / "BUILD.md").read_text()
    assert oldest in build and newest in build


def test_releases_compare_as_numbers():
    assert compat._release("0.12.0.1") == (0, 12, 0, 1)
    assert compat._release("0.6.2") < compat._release("0.12.0.1") < compat._release("0.13.0rc1")


@pytest.mark.skipif(not compat.HAVE_MPI4JAX, reason="mpi4jax is not installed")
def test_mpi4jax_imports_without_a_warning_on_a_tested_jax():
    """On a jax osmm_jax was tested with, mpi4jax's "newer than I know" warning is not shown
    (a fresh process: mpi4jax warns once, at its import)."""
    import subprocess
    import sys

    if compat._release(jax.__version__) > compat._release(compat.TESTED_JAX[1]):
        pytest.skip(f"jax {jax.__version__} is newer than osmm_jax was tested with")
    done = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import osmm_jax._src.compat"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "mpi4jax" not in done.stderr, done.stderr
