"""The Flax that osmm_jax.flax needs, checked on import: an ImportError that says how to get
it, rather than an AttributeError deep inside a layer.

The nnx layers use ``Variable.get_value`` / ``set_value`` and ``nnx.Linear``'s
``preferred_element_type``, which Flax has from 0.12 on (Flax 0.12 itself needs jax >= 0.7.1;
the rest of osmm_jax runs on older JAX too).
"""

from __future__ import annotations

FLAX_MINIMUM = (0, 12)

try:
    import flax
    import flax.linen  # noqa: F401
    from flax import nnx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "osmm_jax.flax needs Flax: pip install 'osmm_jax[flax]' (flax and optax)"
    ) from exc


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "0.12.8" or "0.12.0rc1"."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


if _release(flax.__version__) < FLAX_MINIMUM:
    raise ImportError(
        f"osmm_jax.flax needs flax >= {'.'.join(map(str, FLAX_MINIMUM))}, found "
        f"{flax.__version__} (flax 0.12 needs jax >= 0.7.1): pip install 'osmm_jax[flax]'"
    )
