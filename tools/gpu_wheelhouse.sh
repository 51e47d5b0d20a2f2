#!/usr/bin/env bash
# Downloads into a folder every Python package a GPU machine without network lacks for
# building osmm_jax and running its GPU tests and benchmarks (tools/gpu_session.sh installs
# from it with --no-index). See BUILD.md, "GPUs".
#
#   tools/gpu_wheelhouse.sh [--python 3.12] [--jax 0.11.2] [--with-base] DEST
#
# The wheels are for CPython --python on manylinux x86_64 (binary wheels only), resolved
# against --jax (the JAX the machine has), and hold: the mpich wheel (MPI: mpicc, mpiexec,
# libmpi), the mpi4jax sdist and what building it needs (setuptools, wheel), the test tools
# (pytest, pytest-timeout, hypothesis), flax and optax, and prometheus-client, each with its
# dependencies. What the machine already has is left out (jax, jaxlib, numpy, scipy,
# ml_dtypes, opt_einsum; nanobind, scikit-build-core, mpi4py, cmake, ninja are not asked
# for), unless --with-base, which adds them: a wheelhouse for a rehearsal on a machine that
# has none of them. Prints the folder's size and fails above LIMIT_MIB (default 60).
set -euo pipefail

PYVER=3.12
JAX_VERSION=0.11.2
WITH_BASE=0
while [[ $# -gt 1 ]]; do
  case "$1" in
    --python) PYVER=$2; shift 2 ;;
    --jax) JAX_VERSION=$2; shift 2 ;;
    --with-base) WITH_BASE=1; shift ;;
    *) echo "gpu_wheelhouse.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ $# -eq 1 ]] || { echo "usage: tools/gpu_wheelhouse.sh [--python X.Y] [--jax V] [--with-base] DEST" >&2; exit 2; }
DEST=$1
LIMIT_MIB=${LIMIT_MIB:-60}
PIP=${PIP:-python3 -m pip}
ABI=cp${PYVER/./}

BASE=(numpy scipy ml_dtypes opt_einsum)
WANTED=(mpich "setuptools>=82.0.1" wheel pytest pytest-timeout hypothesis flax optax prometheus-client)
BASE_EXTRA=(nanobind scikit-build-core mpi4py cmake ninja)

mkdir -p "$DEST"
# Binary wheels for the target interpreter and platform (pip resolves for them, not for the
# Python running this script).
$PIP download --disable-pip-version-check -q --dest "$DEST" --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  "${WANTED[@]}" "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" \
  $([[ $WITH_BASE == 1 ]] && echo "${BASE_EXTRA[@]}")
# mpi4jax is published as an sdist only; it is built on the machine, against its MPI and JAX.
$PIP download --disable-pip-version-check -q --dest "$DEST" --no-deps --no-binary mpi4jax \
  "mpi4jax>=0.9,<0.10"

if [[ $WITH_BASE == 0 ]]; then
  for name in jax jaxlib "${BASE[@]}"; do
    rm -f "$DEST/$name"-[0-9]*.whl
  done
fi
size_kib=$(du -sk "$DEST" | cut -f1)
echo "gpu wheelhouse: $DEST, $(ls "$DEST" | wc -l) files, $((size_kib / 1024)) MiB" \
  "(CPython $PYVER, resolved against JAX $JAX_VERSION$([[ $WITH_BASE == 1 ]] && echo ', with the base packages'))"
if [[ $WITH_BASE == 0 && $((size_kib / 1024)) -ge $LIMIT_MIB ]]; then
  echo "gpu wheelhouse: over $LIMIT_MIB MiB, more than the device machine's carry limit allows" >&2
  exit 1
fi
