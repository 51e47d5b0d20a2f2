"""Randomised differential test: many random distributed products against numpy.

Every product draws its own layouts for A, B and C (rows, cols, 2-D grid or replicated, with
uneven and sometimes zero weights, so some blocks are empty), dimensions M, K, N from a set
of 1, small numbers and primes, a dtype, a method, eager or ``jax.jit``, forward only or
forward and gradients, a chunk size (sometimes so small that a product is sent in many
chunks), and in the notified mode (``OSMM_SYNC=notify``) whether a replicated C is staged
(reduce-scatter, then the notified all-gather) however small it is. Each rank checks its own
blocks of C, dA and dB against float64 numpy products of the same rounded inputs, within a
bound that scales with the dtype's rounding and with K.

The cases vary from run to run. Rank 0 picks the seed (``OSMM_TEST_SEED``, or a fresh one)
and broadcasts it, so every rank draws the same cases; case ``i`` depends on the seed and
``i`` alone. The seed is printed and every failure names it with the case, so a failure
replays with ``OSMM_TEST_SEED=<seed> OSMM_TEST_PRODUCTS=<i + 1>``. ``OSMM_TEST_PRODUCTS``
(default 90: 6 batches, a new seed every run) sets how many products a run makes; they run in
batches of 15, one test each, and a last test checks that all of them ran.

Run on 3 ranks: ``mpiexec -n 3 .venv/bin/python tests/mpi/run.py tests/mpi/runtime/test_random_products.py -q -s``.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import time
import traceback
import zlib
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from product_cases import default_sync, product_and_grads_step, rss_mib

import osmm_jax as om
from osmm_jax._src.runtime import slots

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

SEED_VARIABLE = "OSMM_TEST_SEED"
COUNT_VARIABLE = "OSMM_TEST_PRODUCTS"
DEFAULT_COUNT = 90

DIMS = (1, 2, 3, 5, 7, 11, 13, 17, 31)
KINDS = ("rows", "cols", "grid", "replicated")
WEIGHTS = (0.0, 0.5, 1.0, 2.0, 3.0)
# Every dtype matmul accepts, for both methods (osmm_jax._src.dtypes.SUPPORTED).
DTYPES = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
METHODS = ("one_sided", "allreduce")
# None: the default (4 MiB, one chunk at these sizes); 0: no overlap; the others cut the
# partials into chunks of a row or a few rows each.
CHUNK_BYTES = (None, 0, 8, 24, 96)
# Shares of the cases that are jitted, take gradients, verify by checksum, and run an earlier
# case's product of the same batch again (same plan and options, new operands: the steady
# state of a product after others have run, and cheap, since its compiled code is reused).
# Eager products cost several times a jitted one on first use (every operation compiles on
# its own).
JIT_SHARE, GRADS_SHARE, VERIFY_SHARE, REPEAT_SHARE = 0.75, 0.4, 0.1, 0.25
STAGED_SHARE = 0.5
# The cases run in batches, one test each, so that no single test runs for minutes. Every
# compiled product holds several MiB: once a rank has grown by RELEASE_MIB since the first
# batch (or the last release), all ranks drop JAX's compiled code after the batch, so that
# memory stays bounded however many cases a run makes.
BATCH = 15
RELEASE_MIB = 512.0


# -- drawing cases ---------------------------------------------------------------------------


class LayoutSpec(NamedTuple):
    """A layout to build for any shape: its kind and weights (and grid shape for ``grid``)."""

    kind: str
    weights: tuple[float, ...] = ()  # rows/cols: per rank; grid: per row band
    grid: tuple[int, int] | None = None
    col_weights: tuple[float, ...] = ()  # grid: per column band

    def build(self, shape) -> om.Layout:
        """The layout of a matrix of ``shape`` over every rank of COMM_WORLD."""
        if self.kind == "rows":
            return om.Layout.rows(shape, weights=self.weights)
        if self.kind == "cols":
            return om.Layout.cols(shape, weights=self.weights)
        if self.kind == "grid":
            return om.Layout.grid(
                shape, self.grid, row_weights=self.weights, col_weights=self.col_weights
            )
        return om.Layout.replicated(shape)


class Case(NamedTuple):
    """One random product; its repr is what a failure report prints."""

    index: int
    m: int
    k: int
    n: int
    a: LayoutSpec
    b: LayoutSpec
    c: LayoutSpec
    dtype: str
    method: str
    jit: bool
    grads: bool
    chunk_bytes: int | None
    verify: bool
    staged: bool  # notified mode: every replicated C staged (slots.DIRECT_EXTRA_ELEMENTS = 0)
    repeat_of: int | None = None  # the earlier case whose product this one runs again


def random_weights(rng: np.random.Generator, parts: int) -> tuple[float, ...]:
    """``parts`` weights drawn from WEIGHTS: mostly unequal, often with zeros (empty blocks),
    never all zero (a layout needs some rank to hold the matrix)."""
    weights = [float(w) for w in rng.choice(WEIGHTS, size=parts)]
    if not any(weights):
        weights[int(rng.integers(parts))] = 1.0
    return tuple(weights)


def random_grid(rng: np.random.Generator, nranks: int) -> tuple[int, int]:
    """A random ``(rows, cols)`` process grid of exactly ``nranks`` ranks (1 x n, n x 1, ...)."""
    shapes = [(d, nranks // d) for d in range(1, nranks + 1) if nranks % d == 0]
    return shapes[int(rng.integers(len(shapes)))]


def random_layout_spec(rng: np.random.Generator, nranks: int) -> LayoutSpec:
    """A layout of a random kind with random weights, for ``nranks`` ranks."""
    kind = str(rng.choice(KINDS))
    if kind in ("rows", "cols"):
        return LayoutSpec(kind, random_weights(rng, nranks))
    if kind == "grid":
        pr, pc = random_grid(rng, nranks)
        return LayoutSpec(kind, random_weights(rng, pr), (pr, pc), random_weights(rng, pc))
    return LayoutSpec(kind)


def draw_case(seed: int, index: int, nranks: int) -> Case:
    """Case ``index`` of the run seeded ``seed``: a function of those two alone, so one case
    is drawn alike on every rank and can be inspected without running the cases before it.
    Some cases repeat an earlier case's product of the same batch (see REPEAT_SHARE)."""
    rng = np.random.default_rng([seed, index])
    first = index - index % BATCH
    if index > first and rng.random() < REPEAT_SHARE:
        earlier = draw_case(seed, int(rng.integers(first, index)), nranks)
        original = earlier.index if earlier.repeat_of is None else earlier.repeat_of
        return earlier._replace(index=index, repeat_of=original)
    m, k, n = (int(d) for d in rng.choice(DIMS, size=3))
    a, b, c = (random_layout_spec(rng, nranks) for _ in range(3))
    return Case(
        index=index,
        m=m,
        k=k,
        n=n,
        a=a,
        b=b,
        c=c,
        dtype=str(rng.choice(list(DTYPES))),
        method=str(rng.choice(METHODS)),
        jit=bool(rng.random() < JIT_SHARE),
        grads=bool(rng.random() < GRADS_SHARE),
        chunk_bytes=CHUNK_BYTES[int(rng.integers(len(CHUNK_BYTES)))],
        verify=bool(rng.random() < VERIFY_SHARE),
        staged=bool(rng.random() < STAGED_SHARE),
    )


def run_seed_and_count() -> tuple[int, int]:
    """The run's seed and product count, chosen by rank 0 and broadcast to every rank.

    The seed is ``OSMM_TEST_SEED`` if set, else fresh from the clock and ``os.urandom`` (so
    runs differ); the count is ``OSMM_TEST_PRODUCTS`` (default 90).
    """
    choice = None
    if RANK == 0:
        try:
            text = os.environ.get(SEED_VARIABLE, "").strip()
            if text:
                seed = int(text)
            else:
                seed = (time.time_ns() ^ int.from_bytes(os.urandom(8), "little")) % 2**32
            count = int(os.environ.get(COUNT_VARIABLE, "").strip() or DEFAULT_COUNT)
            choice = (seed, count)
        except ValueError as error:  # raised on every rank below, not on rank 0 alone
            choice = f"{SEED_VARIABLE} and {COUNT_VARIABLE} must be integers: {error}"
    choice = COMM.bcast(choice, root=0)
    if isinstance(choice, str):
        raise ValueError(choice)
    return choice


# -- running and checking one case -------------------------------------------------------------


def global_operands(seed: int, case: Case):
    """Global A, B and the cotangent G of C, rounded to the case's dtype (identical on every
    rank: drawn from the run's seed and the case's index)."""
    rng = np.random.default_rng([seed, case.index, 1])
    dtype = DTYPES[case.dtype]
    return tuple(
        rng.standard_normal(shape).astype(dtype)
        for shape in ((case.m, case.k), (case.k, case.n), (case.m, case.n))
    )


@functools.cache
def jitted(plan, method: str, chunk_bytes, verify: bool, grads: bool, staged: bool):
    """The jitted product (or forward-and-gradient step) of one plan and set of options,
    compiled once and reused by every case that draws the same ones."""
    return jax.jit(make_step(plan, method, chunk_bytes, verify, grads, staged))


def make_step(plan, method: str, chunk_bytes, verify: bool, grads: bool, staged: bool):
    """``step(a_loc, b_loc, g_loc) -> (C, dA, dB)`` (dA, dB None without gradients), where dA
    and dB are the gradients of ``sum(C * G)``; ``staged``: every replicated C of the product
    and its gradients staged while the step is traced (or run eagerly)."""

    def product(x, y):
        return om.matmul(x, y, plan, method=method, verify=verify, chunk_bytes=chunk_bytes)

    if grads:
        inner = product_and_grads_step(product)
    else:

        def inner(x, y, g):
            return product(x, y), None, None

    def step(x, y, g):
        names = ("DIRECT_EXTRA_ELEMENTS", "DIRECT_EXTRA_ELEMENTS_MESSAGES")
        before = [getattr(slots, name) for name in names]
        for name, value in zip(names, before):
            setattr(slots, name, 0 if staged else value)
        try:
            return inner(x, y, g)
        finally:
            for name, value in zip(names, before):
                setattr(slots, name, value)

    return step


def error_bound(x: np.ndarray, y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An elementwise bound on ``|computed - exact|`` for the product ``x @ y`` of inputs
    already in ``dtype``: sums of ``k`` terms in the accumulation dtype (float64 for float64,
    float32 otherwise), then one rounding to ``dtype``; twice that, for reordered sums. The
    absolute floor covers results so small that ``dtype`` holds them as subnormals."""
    k = x.shape[1]
    acc = np.float64 if dtype == np.float64 else np.float32
    info = ml_dtypes.finfo(dtype)
    rate = float(info.eps) + k * float(np.finfo(acc).eps)
    return 2 * rate * (np.abs(x) @ np.abs(y)) + float(info.smallest_subnormal)


def compare(name: str, got, layout: om.Layout, exact, bound, dtype) -> str | None:
    """Why this rank's block ``got`` of a result does not match the float64 ``exact`` within
    ``bound`` (all three global, cut to this rank's block here), or None if it does."""
    expected_shape = layout.local_shape(RANK)
    if tuple(got.shape) != expected_shape:
        return f"{name}: shape {tuple(got.shape)}, expected {expected_shape}"
    if np.dtype(got.dtype) != dtype:
        return f"{name}: dtype {got.dtype}, expected {dtype}"
    got = np.asarray(got, np.float64)
    want, allowed = layout.shard(exact, RANK), layout.shard(bound, RANK)
    error = np.abs(got - want)
    bad = ~(error <= allowed)  # NaN counts as bad
    if not bad.any():
        return None
    excess = np.where(bad, error / np.maximum(allowed, np.finfo(np.float64).tiny), -1.0)
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(excess), bad.shape))
    return (
        f"{name}: {int(bad.sum())} of {bad.size} elements off; worst at local {worst}: "
        f"got {float(got[worst])!r}, expected {float(want[worst])!r}, "
        f"allowed error {float(allowed[worst]):.3g}"
    )


def run_case(seed: int, case: Case) -> tuple[str | None, int]:
    """Run one case on this rank; returns (what went wrong here or None, products run)."""
    dtype = DTYPES[case.dtype]
    a_layout = case.a.build((case.m, case.k))
    b_layout = case.b.build((case.k, case.n))
    c_layout = case.c.build((case.m, case.n))
    plan = om.plan(a_layout, b_layout, c_layout)
    a, b, g = global_operands(seed, case)
    a_loc, b_loc, g_loc = a_layout.shard(a, RANK), b_layout.shard(b, RANK), c_layout.shard(g, RANK)
    # Elsewhere staging changes nothing: one compiled step for both.
    staged = case.staged and default_sync().mode == "notify"
    options = (plan, case.method, case.chunk_bytes, case.verify, case.grads, staged)
    step = jitted(*options) if case.jit else make_step(*options)
    c_loc, da, db = jax.block_until_ready(step(a_loc, b_loc, g_loc))

    a64, b64, g64 = (np.asarray(x, np.float64) for x in (a, b, g))
    problems = [compare("C", c_loc, c_layout, a64 @ b64, error_bound(a64, b64, dtype), dtype)]
    if case.grads:
        problems.append(
            compare("dA", da, a_layout, g64 @ b64.T, error_bound(g64, b64.T, dtype), dtype)
        )
        problems.append(
            compare("dB", db, b_layout, a64.T @ g64, error_bound(a64.T, g64, dtype), dtype)
        )
    problems = [p for p in problems if p]
    return ("; ".join(problems) if problems else None), (3 if case.grads else 1)


def describe_layouts(case: Case) -> str:
    """Each rank's block shapes of A, B and C, to read with a failure."""
    parts = []
    for name, spec, shape in (
        ("A", case.a, (case.m, case.k)),
        ("B", case.b, (case.k, case.n)),
        ("C", case.c, (case.m, case.n)),
    ):
        layout = spec.build(shape)
        parts.append(f"{name} blocks {[layout.local_shape(r) for r in range(SIZE)]}")
    return ", ".join(parts)


def run_cases(seed: int, cases: list[Case]) -> tuple[int, int]:
    """Run ``cases`` in order on every rank; returns (matmul calls made, distributed products
    including the backward ones). Fails on every rank, naming the seed, the case and every
    failing rank's error, at the first case that fails on any rank."""
    calls = products = 0
    for case in cases:
        try:
            problem, ran = run_case(seed, case)
        except Exception:  # noqa: BLE001 - reported with the case, on every rank
            problem, ran = traceback.format_exc(limit=6), 0
        # Every rank learns every rank's outcome, so all stop at the same case instead of
        # the healthy ranks waiting in the next product for one that has stopped.
        outcomes = COMM.allgather(problem)
        failed = {r: p for r, p in enumerate(outcomes) if p is not None}
        if failed:
            details = "\n".join(f"  rank {r}: {p}" for r, p in failed.items())
            pytest.fail(
                f"random product failed: seed={seed} case {case.index} "
                f"(replay: {SEED_VARIABLE}={seed} {COUNT_VARIABLE}={case.index + 1})\n"
                f"  {case}\n  {describe_layouts(case)}\n{details}",
                pytrace=False,
            )
        calls += 1
        products += ran
    return calls, products


def release_compiled_code() -> None:
    """Drop the compiled steps and JAX's caches of compiled code (several MiB per product).

    Every rank must do this at the same point: a product traced again runs its all-ranks
    checks again, which the other ranks must join.
    """
    jitted.cache_clear()
    jax.clear_caches()
    gc.collect()
    try:  # hand the freed memory back to the system, so that RSS shows what is still held
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# -- the test ------------------------------------------------------------------------------------

# Chosen once per run, at import, on every rank alike (a collective, as every rank imports
# this module at the same point of collection).
SEED, COUNT = run_seed_and_count()
BATCHES = [range(start, min(start + BATCH, COUNT)) for start in range(0, COUNT, BATCH)]
_calls_made: dict[int, int] = {}  # first case of a batch -> matmul calls it made
_products_made: dict[int, int] = {}  # the same, counting backward products too
_compiled: list[int] = []  # jitted steps compiled before each release of compiled code
_rss_baseline: dict[str, float] = {}  # "MiB": RSS at the first batch or the last release


@pytest.mark.ranks(3)
@pytest.mark.parametrize("indices", BATCHES, ids=[f"cases{b.start}-{b.stop - 1}" for b in BATCHES])
def test_random_products_match_numpy(indices):
    seed = SEED
    if RANK == 0:
        print(
            f"\nrandom products: seed={seed} count={COUNT} (cases {indices.start}-{indices.stop - 1})"
        )
    cases = [draw_case(seed, i, SIZE) for i in indices]
    drawn = COMM.allgather(zlib.crc32(repr(cases).encode()))
    assert len(set(drawn)) == 1, f"seed={seed}: ranks drew different cases"

    started = time.perf_counter()
    _rss_baseline.setdefault("MiB", rss_mib())
    try:
        calls, products = run_cases(seed, cases)
    finally:
        growth = COMM.allreduce(rss_mib() - _rss_baseline["MiB"], op=MPI.MAX)
        released = growth > RELEASE_MIB
        if released:
            _compiled.append(jitted.cache_info().currsize)
            release_compiled_code()
            _rss_baseline["MiB"] = rss_mib()
    _calls_made[indices.start], _products_made[indices.start] = calls, products

    if RANK == 0:
        print(
            f"random products: seed={seed}: cases {indices.start}-{indices.stop - 1}: "
            f"{sum(c.jit for c in cases)} jitted, {sum(c.grads for c in cases)} with "
            f"gradients, {sum(c.repeat_of is not None for c in cases)} repeats; "
            f"{products} distributed products in {time.perf_counter() - started:.1f} s, "
            f"RSS {rss_mib():.0f} MiB{' (compiled code released)' if released else ''}",
            flush=True,
        )
    assert calls == len(indices), f"seed={seed}: {calls} of {len(indices)} products ran"


@pytest.mark.ranks(3)
def test_random_products_all_ran():
    """Every batch above ran all its products: a run makes at least OSMM_TEST_PRODUCTS."""
    calls = sum(_calls_made.values())
    if RANK == 0:
        print(
            f"\nrandom products: seed={SEED} count={COUNT}: {calls} matmul calls made, "
            f"{sum(_products_made.values())} distributed products with the backward ones, "
            f"{sum(_compiled) + jitted.cache_info().currsize} jitted steps compiled",
            flush=True,
        )
    missing = [f"{b.start}-{b.stop - 1}" for b in BATCHES if b.start not in _calls_made]
    assert calls >= COUNT, (
        f"seed={SEED}: {calls} of {COUNT} products ran (batches not run: {missing or 'none'})"
    )
