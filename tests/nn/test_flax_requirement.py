"""osmm_jax.flax refuses a Flax too old for its layers with an ImportError that says what to
install, before any layer is imported."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("flax")

import flax  # noqa: E402

import osmm_jax._src.nn as nn_package  # noqa: E402

try:
    from osmm_jax._src.nn import flax_requirement
except ImportError as refusal:  # the installed flax is older than osmm_jax.flax needs
    flax_requirement, REFUSAL = None, refusal
else:
    REFUSAL = None

# With an old flax installed the refusal above is the real one (checked below); these tests
# fake the installed version, which needs the module that an old flax cannot import.
needs_a_new_flax = pytest.mark.skipif(
    REFUSAL is not None, reason=f"flax {flax.__version__} installed: {REFUSAL}"
)


def test_the_installed_flax_is_refused_exactly_when_it_is_too_old():
    if REFUSAL is None:
        release = flax_requirement._release(flax.__version__)
        assert release >= flax_requirement.FLAX_MINIMUM
    else:
        assert f"needs flax >= 0.12, found {flax.__version__}" in str(REFUSAL)
        assert "pip install 'osmm_jax[flax]'" in str(REFUSAL)


@needs_a_new_flax
@pytest.mark.parametrize(
    "version, release",
    [("0.12.8", (0, 12)), ("0.12.0rc1", (0, 12)), ("0.11.2", (0, 11)), ("1.0", (1, 0))],
)
def test_release_reads_major_and_minor(version, release):
    assert flax_requirement._release(version) == release


@needs_a_new_flax
def test_an_older_flax_is_refused_on_import(monkeypatch):
    monkeypatch.setattr(flax, "__version__", "0.11.2")
    for name in ("osmm_jax.flax", "osmm_jax._src.nn.flax_requirement"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(nn_package, "flax_requirement", raising=False)  # re-run on import
    with pytest.raises(ImportError, match=r"needs flax >= 0\.12, found 0\.11\.2"):
        importlib.import_module("osmm_jax.flax")
    # The refused import left nothing half-imported behind.
    assert "osmm_jax.flax" not in sys.modules
