"""Environment variables and their defaults (osmm_jax/_src/config.py), without MPI."""

from __future__ import annotations

import os
import re

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


@pytest.mark.parametrize("text", ["4MiB", "1.5", "-1", "nan", "0x10"])
def test_garbage_chunk_bytes_names_the_variable_and_the_value(monkeypatch, text):
    monkeypatch.setenv(config.CHUNK_BYTES, text)
    with pytest.raises(ValueError, match=rf"{config.CHUNK_BYTES}.*{text}"):
        config.resolve_chunk_bytes(None)


@pytest.mark.parametrize("name", [config.USE_ALLREDUCE, config.VERIFY])
@pytest.mark.parametrize(
    ("text", "value"), [("0", False), (" Off ", False), ("", False), ("ON", True)]
)
def test_flags_take_yes_and_no_words(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    got = config.resolve_verify(None) if name == config.VERIFY else config.default_method()
    assert got == (value if name == config.VERIFY else ("allreduce" if value else "one_sided"))


@pytest.mark.parametrize("name", [config.USE_ALLREDUCE, config.VERIFY])
@pytest.mark.parametrize("text", ["ture", "2", "allreduce", "y e s"])
def test_a_garbage_flag_is_an_error_not_a_silent_no(monkeypatch, name, text):
    """``OSMM_VERIFY=ture`` must not quietly leave verification off."""
    monkeypatch.setenv(name, text)
    resolve = config.resolve_verify if name == config.VERIFY else config.resolve_method
    with pytest.raises(ValueError, match=rf"{name} must be one of .*got '{text}'"):
        resolve(None)
    assert resolve(True if name == config.VERIFY else "one_sided")  # an argument wins


@pytest.mark.parametrize("text", ["fast,slow", "300;300", "300,,300", "300,-1", "300,nan", "300"])
def test_garbage_speeds_name_the_variable_and_the_value(monkeypatch, text):
    from osmm_jax._src.tuning import speeds

    monkeypatch.setenv(config.SPEEDS, text)
    with pytest.raises(ValueError, match=rf"{config.SPEEDS}='{re.escape(text)}'"):
        speeds.declared_speeds(2)


def test_sync_defaults_by_the_mpi_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv(config.SYNC, raising=False)
    monkeypatch.delenv(config.CUDA_AWARE, raising=False)
    assert config.resolve_sync(None) == "notify"
    # Open MPI's accumulates wait for the target: fences there.
    assert config.resolve_sync(None, waiting_accumulates=True) == "fence"
    monkeypatch.setenv(config.SYNC, " Fence ")
    assert config.resolve_sync(None) == "fence"
    assert config.resolve_sync("notify") == "notify"  # the argument wins
    monkeypatch.delenv(config.SYNC)
    monkeypatch.setenv(config.CUDA_AWARE, "1")  # windows in device memory: fence by default
    assert config.resolve_sync(None) == "fence"


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_a_bad_sync_names_its_source(monkeypatch, source):
    if source == "argument":
        with pytest.raises(ValueError, match="^sync must be one of"):
            config.resolve_sync("barrier")
    else:
        monkeypatch.setenv(config.SYNC, "barrier")
        with pytest.raises(ValueError, match="^OSMM_SYNC must be one of"):
            config.resolve_sync(None)


def test_slot_budget_default_units_and_no_limit(monkeypatch):
    monkeypatch.delenv(config.SLOT_BUDGET, raising=False)
    assert config.slot_budget() == 512 * 2**20
    monkeypatch.setenv(config.SLOT_BUDGET, "64 MiB")
    assert config.slot_budget() == 64 * 2**20
    monkeypatch.setenv(config.SLOT_BUDGET, "none")
    assert config.slot_budget() == float("inf")
    monkeypatch.setenv(config.SLOT_BUDGET, "lots")
    with pytest.raises(ValueError, match="OSMM_SLOT_BUDGET"):
        config.slot_budget()


def test_the_all_reduce_is_mpi4jax_when_installed_else_native(monkeypatch):
    monkeypatch.delenv(config.ALLREDUCE, raising=False)
    assert config.allreduce_implementation(True) == "mpi4jax"
    assert config.allreduce_implementation(False) == "native"
    monkeypatch.setenv(config.ALLREDUCE, " Native ")
    assert config.allreduce_implementation(True) == "native"
    monkeypatch.setenv(config.ALLREDUCE, "mpi4jax")
    assert config.allreduce_implementation(True) == "mpi4jax"
    with pytest.raises(
        ValueError, match=r"mpi4jax is not installed: `pip install osmm_jax\[mpi4jax\]`"
    ):
        config.allreduce_implementation(False)
    monkeypatch.setenv(config.ALLREDUCE, "nccl")
    with pytest.raises(ValueError, match="OSMM_ALLREDUCE must be one of"):
        config.allreduce_implementation(True)


# Flags whose default osmm_jax decides where the product runs: by the communicator (OSMM_DEFER)
# or by the size of what a rank gets (OSMM_FETCH_AHEAD).
LEFT_TO_OSMM = [(config.DEFER, config.defer_finishes), (config.FETCH_AHEAD, config.fetch_ahead)]


@pytest.mark.parametrize(("name", "read"), LEFT_TO_OSMM)
@pytest.mark.parametrize(
    ("text", "value"), [(None, None), ("", None), ("0", False), ("off", False), (" on", True)]
)
def test_flags_left_to_osmm_jax_by_default_are_none_unless_set(
    monkeypatch, name, read, text, value
):
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert read() is value


@pytest.mark.parametrize(("name", "read"), LEFT_TO_OSMM)
def test_a_garbage_value_of_a_flag_left_to_osmm_jax_is_an_error(monkeypatch, name, read):
    monkeypatch.setenv(name, "later")
    with pytest.raises(ValueError, match=rf"{name} must be one of"):
        read()


@pytest.mark.parametrize(
    ("text", "value"), [(None, "auto"), (" ", "auto"), ("RMA", "rma"), ("messages", "messages")]
)
def test_the_transport_is_auto_unless_set(monkeypatch, text, value):
    if text is None:
        monkeypatch.delenv(config.TRANSPORT, raising=False)
    else:
        monkeypatch.setenv(config.TRANSPORT, text)
    assert config.transport() == value


def test_an_unknown_transport_is_an_error(monkeypatch):
    monkeypatch.setenv(config.TRANSPORT, "smoke signals")
    with pytest.raises(ValueError, match=rf"{config.TRANSPORT} must be one of"):
        config.transport()


def test_the_memory_budget_setting_is_one_number_or_one_per_rank(monkeypatch):
    monkeypatch.delenv(config.MEMORY_BUDGET, raising=False)
    assert config.memory_budget_setting() is None
    monkeypatch.setenv(config.MEMORY_BUDGET, " 2GiB ")
    assert config.memory_budget_setting() == 2**31
    monkeypatch.setenv(config.MEMORY_BUDGET, "1GiB,none, 512 MiB")
    assert config.memory_budget_setting() == (2**30, float("inf"), 2**29)
    with pytest.raises(ValueError, match="one budget per rank; this entry point takes one"):
        config.memory_budget()
    monkeypatch.setenv(config.MEMORY_BUDGET, "1GiB,")
    with pytest.raises(ValueError, match="OSMM_MEMORY_BUDGET entry must be a number of bytes"):
        config.memory_budget_setting()


def test_the_host_budget_is_a_share_of_the_smaller_of_memory_and_the_cgroup_limit(
    monkeypatch, tmp_path
):
    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    monkeypatch.setattr(config, "_CGROUP_LIMITS", (str(tmp_path / "absent"), str(limit)))
    assert config.cgroup_memory_limit() == 2**30
    assert config.host_memory_budget() == config.DEFAULT_MEMORY_FRACTION * 2**30
    limit.write_text("max\n")
    assert config.cgroup_memory_limit() == float("inf")
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert config.host_memory_budget() == config.DEFAULT_MEMORY_FRACTION * physical
