#!/usr/bin/env bash
# The canary: osmm_jax on the newest jax/jaxlib the package index serves, whatever the pin says.
#
#   tools/newest_jax_check.sh OUT
#
# In a throw-away venv (OUT/venv, made anew) on PYTHON (default: the newest supported Python
# this machine has): jax and jaxlib at the newest release first, then this checkout as a user
# installs it (build isolation; the `mpich` wheel as its MPI, the `test` extra for pytest and
# Flax), then mpi4jax built against that jax. Every step runs even when one before it broke
# (a pin that refuses the release is reported and overridden with --no-deps): the environment
# report, the compat checks and the single-process runtime and Flax tests, the smoke test on 2
# and 3 ranks, and the core MPI tests on 2 ranks (products, notified reduce, primitives, Flax
# layers). It ends with a table of what passed and what broke (logs in OUT) and exits non-zero
# if anything broke. Nothing else is touched: the project's own venvs stay as they are.
set -uo pipefail

out=$(realpath -m "${1:?usage: $0 OUT}")
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$("$repo/tools/find_python.sh" ${PYTHON:-3.13 3.12 3.11 3.10}) ||
  { echo "no supported Python found"; exit 1; }

rm -rf "$out"
mkdir -p "$out"
venv=$out/venv
"$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip >/dev/null 2>&1

newest=$(pip index versions jax 2>/dev/null | sed -n 's/^jax (\(.*\))$/\1/p')
[ -n "$newest" ] || { echo "the package index names no jax release"; exit 1; }
echo "newest jax for Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'): $newest"

results=()
record() { results+=("$(printf '%-44s %s' "$1" "$2")"); }
# step NAME LOG COMMAND...: run COMMAND (output to OUT/LOG), record passed or broke.
step() {
  local name=$1 log=$2
  shift 2
  if (cd "$out" && env -u VIRTUAL_ENV PATH="$venv/bin:$PATH" "$@") >"$out/$log" 2>&1; then
    record "$name" "passed"
  else
    record "$name" "BROKE (see $log; last line: $(grep -av '^\s*$' "$out/$log" | tail -1 | cut -c1-90))"
  fi
}

step "install jax/jaxlib $newest" install-jax.log \
  "$venv/bin/python" -m pip install "jax==$newest" "jaxlib==$newest"
step "pip install osmm_jax[mpich,test]" install-osmm.log \
  env -u MPI_CXX_COMPILER -u MPICXX PATH="$venv/bin:/usr/local/bin:/usr/bin:/bin" \
  "$venv/bin/python" -m pip install "$repo[mpich,test]"
kept=$(pip show jax 2>/dev/null | sed -n 's/^Version: //p')
if [ "$kept" != "$newest" ]; then
  record "the pin admits jax $newest" "BROKE (installing osmm_jax left jax $kept)"
  pip install -q --no-deps "jax==$newest" "jaxlib==$newest" >>"$out/install-jax.log" 2>&1
else
  record "the pin admits jax $newest" "passed"
fi
# mpi4jax's sdist builds against the venv's jax (no isolation) with the venv's MPI compiler,
# on a PATH without nvcc (its build looks for CUDA next to it).
pip install -q setuptools wheel nanobind >>"$out/install-mpi4jax.log" 2>&1
step "mpi4jax built against jax $newest" install-mpi4jax.log \
  env PATH="$venv/bin:/usr/bin:/bin" MPI4JAX_BUILD_MPICC="$venv/bin/mpicc" \
  "$venv/bin/python" -m pip install --no-cache-dir --no-build-isolation 'mpi4jax>=0.9'
step "python -m osmm_jax" report.log python -m osmm_jax
step "compat, runtime and Flax tests (1 process)" serial.log \
  python -m pytest -q -p no:cacheprovider --timeout=300 "$repo/tests/test_compat.py" \
  "$repo/tests/runtime" "$repo/tests/nn"
for ranks in 2 3; do
  step "smoke test on $ranks ranks" "smoke-$ranks.log" \
    timeout 300 mpiexec -n "$ranks" python "$repo/tools/smoke.py"
done
step "core MPI tests on 2 ranks" mpi-2.log \
  timeout 1200 mpiexec -n 2 python "$repo/tests/mpi/run.py" -q -p no:cacheprovider \
  --timeout=300 --timeout-method=thread "$repo/tests/mpi/runtime/test_matmul.py" \
  "$repo/tests/mpi/runtime/test_notify.py" "$repo/tests/mpi/runtime/test_primitives.py" \
  "$repo/tests/mpi/nn/test_flax.py"

echo
echo "osmm_jax on jax/jaxlib $newest (logs in $out):"
printf '  %s\n' "${results[@]}"
if printf '%s\n' "${results[@]}" | grep -q BROKE; then
  echo "something broke on jax $newest"
  exit 1
fi
echo "nothing broke on jax $newest"
