"""Parameter paths: the names of a JAX key path and prefix tests."""

from __future__ import annotations

import jax

from osmm_jax._src.nn.param_paths import path_names, under


def test_key_paths_become_names():
    tree = {"params": {"Dense_0": {"kernel": 1}}, "layers": [2, 3]}
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert [path_names(path) for path, _ in flat] == [
        ("layers", 0),
        ("layers", 1),
        ("params", "Dense_0", "kernel"),
    ]


def test_a_path_is_under_its_prefixes_and_itself():
    path = ("params", "down", "kernel")
    assert under(path, [("params", "down")])
    assert under(path, [("params", "up"), path])
    assert not under(path, [("params", "down", "bias")])
    assert not under(("params",), [("params", "down")])  # shorter than the prefix
    assert not under(path, [])
