"""The CUDA handlers: built, importable, and registered with XLA for platform CUDA.

Nothing here runs on a GPU (see tests/mpi/runtime/test_gpu.py and ``make gpu-test`` for that): this
checks what a machine without one can, that a build with the CUDA part registers its targets
under "CUDA" and the CPU targets under the host platform, and lowers for both platforms.
Skipped, with the reason, where the build has no CUDA part.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("jax")
from jax._src.lib import xla_client  # noqa: E402  (after the importorskip)

from osmm_jax._src.runtime import native  # noqa: E402

TARGETS = {
    "osmm_fetch",
    "osmm_reduce_start",
    "osmm_reduce_issue",
    "osmm_reduce_finish",
    "osmm_watch",
}
# The CPU module also holds the native all-reduce (the allreduce method without mpi4jax) and
# the deferred reduce (OSMM_DEFER=1).
CPU_TARGETS = TARGETS | {
    "osmm_allreduce",
    "osmm_reduce_start_deferred",
    "osmm_reduce_finish_deferred",
}
CUDA_BUILT = importlib.util.find_spec("osmm_jax._src.runtime._osmm_ffi_cuda") is not None


def registered_ffi_targets(xla_platform: str) -> set[str]:
    """Names of the custom-call targets registered for ``xla_platform`` ("Host", "CUDA"), read
    from XLA's registry (JAX has no public listing of it).

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


def test_cpu_targets_are_registered_for_the_host_platform():
    assert "cpu" in native.platforms()
    assert set(native.MODULES["cpu"].registrations()) == CPU_TARGETS
    assert CPU_TARGETS <= registered_ffi_targets("Host")


def test_the_record_format_comes_from_the_native_module():
    assert native.RECORD_FIELDS[:2] == ("kind", "target")
    assert native.RECORD_LENGTH == 8
    assert {native.OP_ACCUMULATE, native.OP_PUT} == {0, 1}
    assert {native.REGION_A, native.REGION_B} == {0, 1}


@pytest.mark.skipif(not CUDA_BUILT, reason="this build of osmm_jax has no CUDA part")
def test_cuda_targets_are_registered_for_platform_cuda():
    assert "cuda" in native.platforms(), native.UNAVAILABLE.get("cuda")
    module = native.MODULES["cuda"]
    assert set(module.registrations()) == TARGETS
    assert TARGETS <= registered_ffi_targets("CUDA")
    # The CPU targets are still there, and distinct handlers.
    assert TARGETS <= registered_ffi_targets("Host")
    cpu = native.MODULES["cpu"].registrations()
    assert all(module.registrations()[t] is not cpu[t] for t in TARGETS)
    assert module.mpi_cuda_support() in (-1, 0, 1)


@pytest.mark.skipif(not CUDA_BUILT, reason="this build of osmm_jax has no CUDA part")
def test_the_primitives_lower_for_cuda_to_the_registered_targets():
    import jax
    import jax.numpy as jnp

    from osmm_jax._src.runtime import primitives

    def fetch(a, b):
        return primitives.fetch(
            a,
            b,
            comm=0,
            call_id=1,
            window_bytes=64,
            b_offset=0,
            expose_a=False,
            expose_b=False,
            gets=(),
            fetched_elements=4,
        )

    x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    text = jax.jit(fetch).trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert "osmm_fetch" in text


@pytest.mark.skipif(CUDA_BUILT, reason="this build of osmm_jax has a CUDA part")
def test_without_the_cuda_part_the_reason_is_recorded():
    assert "cuda" not in native.platforms()
    assert "without its CUDA handlers" in native.UNAVAILABLE["cuda"]
