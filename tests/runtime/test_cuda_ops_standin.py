"""The CUDA platform's buffer logic (xla_ffi/cuda/cuda_ops.cc) run on a machine without a GPU.

tests/native/cuda_ops_driver.cc compiles cuda_ops.cc unchanged against a host stand-in for the
CUDA runtime (tests/native/cuda_standin/), links the installed native core (libosmm_core, as the
CUDA module does), and runs the core's fetch and reduce once over the CPU platform's BufferOps
and once over CudaBufferOps, on the same transfer records (tests/native/cuda_ops_cases.h), under
mpiexec: the CUDA path must give the CPU path's bytes, and the CPU path the bytes the records
call for. The driver's header says what else it checks, and what only a GPU can
(tests/mpi/runtime/test_gpu.py).

The build (three files, a few seconds) goes to a temporary directory, once per module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import pytest
from jobs import MPIEXEC, REPO, job_environment, mpiexec, native_environment, run_job

NATIVE = REPO / "tests" / "native"
MPICXX = MPIEXEC.parent / "mpicxx"
RUN_TIMEOUT = 90  # seconds for one mpiexec run (a few seconds normally)


def _core_library() -> Path:
    """libosmm_core.so as installed next to the CPU module (``make install``)."""
    spec = importlib.util.find_spec("osmm_jax._src.runtime._osmm_ffi")
    assert spec and spec.origin, "osmm_jax's native extension is not built (make install)"
    return Path(spec.origin).parent / "libosmm_core.so"


def _compile(flags: list[str], source: Path, obj: Path) -> None:
    done = subprocess.run(
        [str(MPICXX), *flags, "-c", str(source), "-o", str(obj)],
        capture_output=True,
        text=True,
        env=native_environment(),
    )
    if done.returncode != 0:
        pytest.fail(f"compiling {source.relative_to(REPO)} failed:\n{done.stderr}")


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The driver, built with the MPI compiler wrapper of this environment."""
    if not MPICXX.exists():
        pytest.skip(f"no MPI compiler wrapper at {MPICXX}")
    compiler = os.environ.get("MPICH_CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) for {MPICXX.name}")
    build = tmp_path_factory.mktemp("cuda_ops_standin")
    # The stand-in's directory first: its cuda_runtime_api.h replaces the toolkit's.
    flags = [
        "-std=c++17",
        "-O0",
        "-pthread",
        "-Wall",
        "-Wextra",
        "-DOMPI_SKIP_MPICXX=1",
        "-DMPICH_SKIP_MPICXX=1",
        f"-I{NATIVE / 'cuda_standin'}",
        "-isystem",
        jax.ffi.include_dir(),
        f"-I{REPO / 'xla_ffi'}",
    ]
    sources = [
        NATIVE / "cuda_ops_driver.cc",
        NATIVE / "cuda_standin" / "cuda_runtime_standin.cc",
        REPO / "xla_ffi" / "cuda" / "cuda_ops.cc",
    ]
    objects = [build / f"{source.stem}.o" for source in sources]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda pair: _compile(flags, *pair), zip(sources, objects)))
    executable = build / "cuda_ops_driver"
    core = _core_library()
    link = [str(core), f"-Wl,-rpath,{core.parent}"]
    done = subprocess.run(
        [str(MPICXX), "-pthread", *map(str, objects), *link, "-o", str(executable)],
        capture_output=True,
        text=True,
        env=native_environment(),
    )
    if done.returncode != 0:
        pytest.fail(f"linking the driver failed:\n{done.stderr}")
    return executable


def _run(driver: Path, ranks: int, **settings: str) -> str:
    """Run the driver on ``ranks`` ranks; its summary line (rank 0's)."""
    env = native_environment(job_environment(drop=("OSMM_",), **settings))
    ended = run_job([*mpiexec(ranks), str(driver)], env, RUN_TIMEOUT)
    assert ended.status == 0, f"status {ended.status}\n{ended.stdout}\n{ended.stderr}"
    return ended.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("ranks", [2, 3])
def test_host_staged_copies_give_the_cpu_paths_bytes(driver: Path, ranks: int) -> None:
    summary = _run(driver, ranks)
    assert summary.startswith(f"passed: host-staged, {ranks} ranks"), summary


@pytest.mark.parametrize("ranks", [2, 3])
def test_cuda_aware_windows_give_the_cpu_paths_bytes(driver: Path, ranks: int) -> None:
    summary = _run(driver, ranks, OSMM_CUDA_AWARE="1", OSMM_STANDIN_MPI_CUDA="1")
    assert summary.startswith(f"passed: CUDA-aware, {ranks} ranks"), summary


def test_cuda_aware_is_refused_on_every_rank_without_mpi_support(driver: Path) -> None:
    summary = _run(driver, 2, OSMM_CUDA_AWARE="1")
    assert summary.startswith("passed: CUDA-aware without MPI support, 2 ranks"), summary
