"""Parameter paths: which leaves of a parameter or gradient tree lie under which layers.

A path is a tuple of names from the tree's root (``("params", "Dense_0", "kernel")``); the
osmm_jax layers name the paths whose gradients their products already sum as prefixes of
them. Pure Python: JAX's path keys are read by their attributes.
"""

from __future__ import annotations

from collections.abc import Iterable


def path_names(path) -> tuple:
    """A JAX key path (``jax.tree_util.tree_flatten_with_path``) as a tuple of names: a dict
    key's key, an attribute's name, a sequence entry's index."""
    return tuple(_key_name(k) for k in path)


def under(names: tuple, prefixes: Iterable[tuple]) -> bool:
    """Whether the path ``names`` starts with one of ``prefixes`` (or is one of them)."""
    return any(names[: len(p)] == p for p in prefixes)


def _key_name(key):
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)
