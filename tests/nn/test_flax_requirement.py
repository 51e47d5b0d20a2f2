"""osmm_jax.flax refuses a Flax too old for its layers with an ImportError that says what to
install, before any layer is imported."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("flax")

import osmm_jax._src.nn as nn_package  # noqa: E402
from osmm_jax._src.nn import flax_requirement  # noqa: E402


@pytest.mark.parametrize(
    "version, release",
    [("0.12.8", (0, 12)), ("0.12.0rc1", (0, 12)), ("0.11.2", (0, 11)), ("1.0", (1, 0))],
)
def test_release_reads_major_and_minor(version, release):
    assert flax_requirement._release(version) == release


def test_an_older_flax_is_refused_on_import(monkeypatch):
    import flax

    monkeypatch.setattr(flax, "__version__", "0.11.2")
    for name in ("osmm_jax.flax", "osmm_jax._src.nn.flax_requirement"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(nn_package, "flax_requirement", raising=False)  # re-run on import
    with pytest.raises(ImportError, match=r"needs flax >= 0\.12, found 0\.11\.2"):
        importlib.import_module("osmm_jax.flax")
    # The refused import left nothing half-imported behind.
    assert "osmm_jax.flax" not in sys.modules
