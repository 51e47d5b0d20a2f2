"""Every private JAX and mpi4jax name osmm_jax uses, in one place.

osmm_jax pins ``jax`` and ``mpi4jax`` to version ranges (pyproject.toml), but the names below
are not public API and may move between releases. When one does, this module is the only
place to change. Nothing else in osmm_jax imports from ``jax._src`` or ``mpi4jax._src``.
"""

from __future__ import annotations

from jax._src.dispatch import apply_primitive
from jax._src.lib import xla_client
from mpi4jax._src.jax_compat import abstract_token, get_token_effect, set_token_effect
from mpi4jax._src.utils import ordered_effect

__all__ = [
    "abstract_token",
    "apply_primitive",
    "get_token_effect",
    "ordered_effect",
    "registered_ffi_targets",
    "set_token_effect",
]


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
