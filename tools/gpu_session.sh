#!/usr/bin/env bash
# One call on a lent GPU machine, from bare to results (BUILD.md, "GPUs"):
#
#   tools/gpu_session.sh OUT          on the GPU machine, from a copy of the working tree plus
#                                     gpu-wheelhouse/ (make gpu-wheelhouse, here)
#   tools/gpu_session.sh --cpu OUT    the rehearsal on a CPU machine (make gpu-rehearsal): the
#                                     same install and build steps, the CUDA steps skipped
#
# Installs only from the wheelhouse (GPU_WHEELHOUSE, default gpu-wheelhouse; pip --no-index)
# into a venv (GPU_VENV, default .venv-gpu) that sees the machine's own packages (JAX and its
# CUDA plugin, nanobind, scikit-build-core, mpi4py: --system-site-packages), builds mpi4jax and
# osmm_jax (with its CUDA handlers), then runs the steps below, each under its own time limit,
# (GPU_STEP_SCALE multiplies every limit: the rehearsal on a small machine sets it),
# each writing OUT/NN-step.log as soon as it ends, so a run cut short still returns what it did:
#   a versions     versions, the MPI library, osmm_jax's native modules, nvidia-smi
#   b cpu-smoke    tools/smoke.py on 2 ranks on the CPU: products and gradients, both methods
#   c cuda-smoke   the same on the GPU, 2 ranks sharing it (host-staged)
#   d gpu-bench    make gpu-bench, results into OUT/benchmarks/
#   e gpu-test     make gpu-test
#   f cuda-aware   OSMM_CUDA_AWARE=1: right results where the MPI reports CUDA support, else
#                  the clear error it must give
# and ends with a summary table (OUT/summary.md). Exit status: 0 when no step failed.
#
# In the rehearsal the wheelhouse is one for this machine's Python with the base packages
# (tools/gpu_wheelhouse.sh --with-base), the machine's own packages are emulated by a second
# venv (GPU_MACHINE_ENV, default gpu-rehearsal/machine) that the session venv sees through a
# .pth file, and steps c-f are skipped, saying so (d and e run their CPU plumbing only where
# stated in the summary).
set -uo pipefail

MODE=gpu
if [[ ${1:-} == --cpu ]]; then MODE=cpu; shift; fi
[[ $# -eq 1 ]] || { echo "usage: tools/gpu_session.sh [--cpu] OUT" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "$1")
cd "$REPO"
mkdir -p "$OUT"
WHEELHOUSE=$(realpath -m "${GPU_WHEELHOUSE:-gpu-wheelhouse}")
VENV=${GPU_VENV:-.venv-gpu}
PY=$VENV/bin/python
# (A string, not an array, so that the exported step functions can use it.)
PIP_OFFLINE="-m pip --disable-pip-version-check install --no-index --find-links $WHEELHOUSE"
SUMMARY=$OUT/summary.md
STEP=0
FAILED=0
printf '| step | result | seconds |\n| --- | --- | ---: |\n' >"$SUMMARY"

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND under `timeout`, its output in
# OUT/NN-NAME.log, and adds a row to the summary.
step() {
  local name=$1 limit=$(($2 * ${GPU_STEP_SCALE:-1}))
  shift 2
  STEP=$((STEP + 1))
  local log
  log=$(printf '%s/%02d-%s.log' "$OUT" "$STEP" "$name")
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  # Through bash -c, so that COMMAND may be one of the functions below (exported).
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$log" 2>&1
  local rc=$? seconds=$((SECONDS - start)) result
  case $rc in
    0) result=passed ;;
    124 | 137) result="TIMED OUT after ${limit}s" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  [[ $rc == 0 ]] || FAILED=1
  printf '| %s | %s | %d |\n' "$name" "$result" "$seconds" >>"$SUMMARY"
  echo "   $result in ${seconds}s; log: $log"
  tail -n 5 "$log" | sed 's/^/   | /'
}

skip() {
  printf '| %s | skipped: %s | 0 |\n' "$1" "$2" >>"$SUMMARY"
  echo "== $1 skipped: $2"
}

# The CUDA toolkit for the builds: CUDA_ROOT, else the one nvcc belongs to, else /usr/local/cuda.
cuda_root() {
  if [[ -n ${CUDA_ROOT:-} ]]; then echo "$CUDA_ROOT"; return; fi
  local nvcc
  nvcc=$(command -v nvcc || true)
  if [[ -n $nvcc && -f $(dirname "$(dirname "$(readlink -f "$nvcc")")")/include/cuda_runtime.h ]]; then
    dirname "$(dirname "$(readlink -f "$nvcc")")"
  elif [[ -f /usr/local/cuda/include/cuda_runtime.h ]]; then
    echo /usr/local/cuda
  fi
}

make_machine_env() {
  # The rehearsal's stand-in for the GPU machine's own packages; prints its python.
  local machine=${GPU_MACHINE_ENV:-gpu-rehearsal/machine}
  python3 -m venv "$machine" >&2
  "$machine/bin/python" $PIP_OFFLINE jax jaxlib numpy scipy ml_dtypes opt_einsum nanobind \
    scikit-build-core mpi4py cmake ninja >&2
  echo "$(realpath "$machine")/bin/python"
}

# The session venv sees the machine's own packages (JAX, its CUDA plugin, nanobind, mpi4py...):
# through --system-site-packages where they are the system's, else (python3 is itself a venv,
# or the rehearsal's stand-in) through a .pth file naming their folders.
see_machine_packages() {
  local machine_python=$1
  if "$PY" -c "import jax" 2>/dev/null; then return; fi
  "$machine_python" -c 'import sysconfig; print(sysconfig.get_path("purelib")); print(sysconfig.get_path("platlib"))' |
    sort -u >"$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/osmm-machine.pth"
  export PATH="$PATH:$(dirname "$machine_python")"  # its cmake and ninja, if installed there
  "$PY" -c "import jax" || { echo "the machine's JAX is not importable from $VENV" >&2; return 1; }
}

install() {
  set -e
  rm -rf "$VENV"
  local machine_python=python3
  [[ $MODE == gpu ]] || machine_python=$(make_machine_env)
  python3 -m venv --system-site-packages "$VENV"
  see_machine_packages "$machine_python"
  "$PY" $PIP_OFFLINE mpich setuptools wheel pytest pytest-timeout hypothesis flax optax \
    prometheus-client
  local root
  root=$(cuda_root)
  # mpi4jax: against the venv's MPI, and with its CUDA bridge where a toolkit is found.
  env PATH="$REPO/$VENV/bin:$PATH" MPI4JAX_BUILD_MPICC="$REPO/$VENV/bin/mpicc" \
    ${root:+CUDA_ROOT=$root} \
    "$PY" $PIP_OFFLINE --no-build-isolation --no-deps mpi4jax
  # osmm_jax, editable (the Makefile's targets run from the checkout), with its CUDA handlers;
  # --no-deps: the machine's JAX stands whatever osmm_jax's pin says.
  "$PY" $PIP_OFFLINE --no-build-isolation --no-deps -e . \
    -Cbuild-dir="build/session-{wheel_tag}" -Ccmake.define.OSMM_ENABLE_CUDA=ON \
    ${root:+-Ccmake.define.CUDAToolkit_ROOT=$root}
}

versions() {
  set -e
  "$PY" - <<'EOF'
import platform, sys
import jax, jaxlib, mpi4py
from mpi4py import MPI
import osmm_jax
from osmm_jax._src.runtime import native
print("python", platform.python_version(), sys.executable)
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "devices", jax.devices())
print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])
print("osmm_jax native platforms:", native.platforms(), "unavailable:", native.UNAVAILABLE)
EOF
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not on this machine"; fi
}

export MODE REPO VENV PY PIP_OFFLINE
export -f install make_machine_env see_machine_packages cuda_root versions
MPIEXEC=$VENV/bin/mpiexec
MAKE_GPU=(make --no-print-directory VENV="$VENV" GPU_DEPS=)

echo "osmm_jax GPU session ($MODE), repository $REPO, output $OUT"
step install 420 install
if [[ $FAILED != 0 ]]; then
  echo "install failed: nothing else can run (log: $OUT/01-install.log)"
  cat "$SUMMARY"
  exit 1
fi
step versions 60 versions
step cpu-smoke 180 env JAX_PLATFORMS=cpu "$MPIEXEC" -n 2 "$PY" tools/smoke.py
if [[ $MODE == gpu ]]; then
  GPU=(env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3)
  step cuda-smoke 180 "${GPU[@]}" "$MPIEXEC" -n 2 "$PY" tools/smoke.py
  step gpu-bench 240 "${MAKE_GPU[@]}" gpu-bench GPU_BENCH_OUT="$OUT/benchmarks"
  step gpu-test 420 "${MAKE_GPU[@]}" gpu-test
  step cuda-aware 180 "${GPU[@]}" OSMM_CUDA_AWARE=1 "$MPIEXEC" -n 2 "$PY" tools/smoke.py --cuda-aware
else
  skip cuda-smoke "no GPU (rehearsal)"
  # The benchmark and test plumbing on the CPU, at a small size: the scripts, their options and
  # where their results go.
  step gpu-bench-on-cpu 300 "${MAKE_GPU[@]}" gpu-bench GPU_PLATFORM=cpu \
    GPU_BENCH_OUT="$OUT/benchmarks" GPU_FFN_DIMS="--m 254 --k 256 --n 512 --repeats 3" \
    GPU_STAGING_DIMS="--m 254 --k 256 --n 512 --repeats 3 --dtype float32"
  skip gpu-test "no GPU (rehearsal; tests/mpi/runtime/test_gpu.py would skip every case)"
  skip cuda-aware "no GPU (rehearsal)"
fi
echo
cat "$SUMMARY"
exit $FAILED
