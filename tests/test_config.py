"""Environment variables and their defaults (osmm_jax/_src/config.py), without MPI."""

from __future__ import annotations

import pytest

from osmm_jax._src import config


def test_chunk_bytes_defaults_to_4_mib_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(config.CHUNK_BYTES, raising=False)
    assert config.resolve_chunk_bytes(None) == 4 << 20
    monkeypatch.setenv(config.CHUNK_BYTES, "65536")
    assert config.resolve_chunk_bytes(None) == 65536
    assert config.resolve_chunk_bytes(0) == 0  # the argument wins; 0 turns overlap off


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, ">= 0"),
        (1.5, TypeError, "int"),
        (True, TypeError, "int"),
        ("4", TypeError, "int"),
    ],
)
def test_bad_chunk_bytes_are_rejected(value, error, match):
    with pytest.raises(error, match=match):
        config.resolve_chunk_bytes(value)


def test_bad_chunk_bytes_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv(config.CHUNK_BYTES, "4MiB")
    with pytest.raises(ValueError, match=config.CHUNK_BYTES):
        config.resolve_chunk_bytes(None)


def test_method_and_verify_defaults(monkeypatch):
    monkeypatch.delenv(config.USE_ALLREDUCE, raising=False)
    monkeypatch.delenv(config.VERIFY, raising=False)
    assert config.resolve_method(None) == "one_sided"
    assert config.resolve_verify(None) is False
    monkeypatch.setenv(config.USE_ALLREDUCE, "1")
    monkeypatch.setenv(config.VERIFY, "yes")
    assert config.resolve_method(None) == "allreduce"
    assert config.resolve_verify(None) is True
    with pytest.raises(ValueError, match="method"):
        config.resolve_method("ring")
