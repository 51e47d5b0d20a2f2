"""Experiments on how XLA:CPU runs osmm_jax's custom calls (see benchmarks/overlap_probe.py for
the schedule and timeline probes, and benchmarks/results/overlap.md for what both found).

``blocked`` (MPI, 2 ranks)
    A one-sided product whose finish on rank 0 waits because rank 1 sleeps (a host callback)
    before its partial, and a large GEMM on rank 0 that is independent of the product, ready
    together with the finish (it depends on the start's ticket), or after the finish; YNN and
    DotThunk GEMMs, notified and fence modes. If XLA ran the GEMM while the finish waits,
    rank 0 takes max(wait, GEMM), else wait + GEMM; per-thunk spans from the profiler.
    ``--pad`` adds small independent kernels so that the program runs on the concurrent
    executor (at most 8 thunks run sequentially).
``effects`` (one process)
    Two sleeping ``jax.debug.callback`` calls, unordered (side-effecting, no token) and
    ordered: whether XLA:CPU runs side-effecting custom calls concurrently.
``async`` (one process)
    Stand-in start / finish handlers (benchmarks/overlap_async_ffi.cc, built here with g++)
    with a blocking finish against one returning an ``xla::ffi::Future``, and a GEMM ready
    together with the finish.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks.overlap_probe import (
    COMM,
    RANK,
    SIZE,
    describe_sequence,
    thunk_spans,
    trace_events,
    traced,
    wall_times,
)


def _ticket_spy():
    """Make ``primitives.reduce_start`` remember the ticket it returns (the last one traced),
    so that a probe can make a GEMM depend on the start: ready at the same moment as the
    finish. Only this process's module attribute changes, for the probe's own programs."""
    from osmm_jax._src.runtime import primitives

    seen = {}
    original = primitives.reduce_start

    def spy(*args, **kwargs):
        seen["ticket"] = original(*args, **kwargs)
        return seen["ticket"]

    primitives.reduce_start = spy
    return seen


def probe_blocked(args) -> None:
    """See the module docstring. Needs exactly 2 ranks."""
    from osmm_jax._src.runtime import one_sided
    from osmm_jax._src.runtime.matmul import _resolve_sync

    assert SIZE == 2, "the blocked probe runs on 2 ranks"
    n = args.n
    # A K-split product: C (n x n) replicated, each rank's partial goes to the other rank,
    # so rank 0's finish waits until rank 1 has sent its partial.
    p = om.plan(
        om.Layout.cols((n, 2 * n)),
        om.Layout.rows((2 * n, n)),
        om.Layout.replicated((n, n)),
    )
    rng = np.random.default_rng(RANK)
    a = jnp.asarray(rng.standard_normal(p.a.local_shape(RANK)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(p.b.local_shape(RANK)), jnp.float32)
    # Rank 0 has the big independent GEMM; rank 1 a token one (its own time is the sleep).
    big = args.big if RANK == 0 else 16
    g = jnp.asarray(rng.standard_normal((big, big)) / np.sqrt(big), jnp.float32)
    smalls = tuple(jnp.full((64, 64), float(i), jnp.float32) for i in range(args.pad))
    delay = args.delay
    seen = _ticket_spy()

    def sleepy(x):
        # Rank 1 sleeps before its partial exists (a host callback the partial depends on).
        def host(v):
            if RANK == 1:
                time.sleep(delay)
            return v

        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    gemms = {
        # x @ x: XLA:CPU emits a YNN fusion thunk (synchronous, "may block").
        "ynn": lambda x: (x @ x).sum(),
        # x.T @ x (contracting the leading dimensions): a DotThunk (Eigen, asynchronous).
        "dot": lambda x: jax.lax.dot_general(x, x, (((0,), (0,)), ((), ()))).sum(),
    }

    def padding(smalls):
        # Independent small kernels, so that the program has more thunks than the executor's
        # threshold for running sequentially (8).
        return [jnp.sin(s * (i + 1)) for i, s in enumerate(smalls)]

    def program(kind: str, gemm, sync=None):
        def product(a, b):
            if kind.startswith("after_start"):
                # one_sided.forward directly (what osmm_jax.matmul runs inside its custom_vjp
                # and custom_vmap), so that the start's ticket is visible in this trace.
                return one_sided.forward(p, RANK, a, b, sync=_resolve_sync(sync))
            return om.matmul(a, b, p, sync=sync)

        def f(a, b, g, smalls):
            if kind == "gemm_only":
                return a, gemm(g), padding(smalls)
            c = product(sleepy(a), b)
            if kind == "product_only":
                return c, jnp.float32(0), padding(smalls)
            if kind == "independent":
                x = g
            elif kind.startswith("after_start"):
                x = jnp.where(seen["ticket"] < 0, jnp.zeros_like(g), g)
            elif kind == "after_finish":
                x = g + 0.0 * c[0, 0]
            return c, gemm(x), padding(smalls)

        return jax.jit(f)

    variants = {}
    for gname, gemm in gemms.items():
        for kind in ("independent", "after_start", "after_finish"):
            variants[f"{kind}/{gname}"] = program(kind, gemm)
        variants[f"gemm_only/{gname}"] = program("gemm_only", gemm)
    variants["product_only"] = program("product_only", None)
    # The fence mode: its start opens a collective fence epoch.
    variants["independent/ynn/fence"] = program("independent", gemms["ynn"], "fence")
    variants["after_start/ynn/fence"] = program("after_start", gemms["ynn"], "fence")
    variants["product_only/fence"] = program("product_only", None, "fence")

    results = {}
    out = os.path.join(args.out, f"rank{RANK}")
    os.makedirs(out, exist_ok=True)
    for name, fn in variants.items():
        operands = (a, b, g, smalls)
        tag = name.replace("/", "_")
        text = fn.lower(*operands).compile().as_text()
        with open(os.path.join(out, f"blocked_{tag}_hlo.txt"), "w") as f:
            f.write(text)
        jax.block_until_ready(fn(*operands))  # compile, warm up
        jax.effects_barrier()
        times = wall_times(fn, operands, args.repeats, barrier=True)
        jax.effects_barrier()
        logdir = os.path.join(out, f"trace_{tag}")
        traced(fn, operands, logdir, 2)
        events = trace_events(logdir)
        results[name] = {
            "seconds": times,
            "median": float(np.median(times)),
            "sequence": describe_sequence(text),
            "events": [e for e in events if not e["name"].startswith("$")],
        }
        COMM.Barrier()
        if RANK == 0:
            print(f"{name:<24} rank 0 median {results[name]['median'] * 1e3:7.1f} ms", flush=True)
    with open(os.path.join(out, "blocked.json"), "w") as f:
        json.dump(results, f, indent=1)


def _load_async_ffi() -> None:
    """Build benchmarks/overlap_async_ffi.cc against jax's FFI headers (in a temporary
    directory, removed once the library is loaded) and register its handlers for the CPU."""
    import ctypes
    import subprocess
    import tempfile

    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap_async_ffi.cc")
    with tempfile.TemporaryDirectory() as build:
        library = os.path.join(build, "overlap_async_ffi.so")
        subprocess.run(
            ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]
            + [source, "-o", library, "-lpthread"],
            check=True,
        )
        lib = ctypes.cdll.LoadLibrary(library)
    for name, symbol in (
        ("probe_start", "ProbeStart"),
        ("probe_finish_sync", "ProbeFinishSync"),
        ("probe_finish_async", "ProbeFinishAsync"),
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")


def probe_async(args) -> None:
    """A start / finish pair of stand-in custom calls (overlap_async_ffi.cc; the finish waits
    ``--delay`` seconds after the start) and a GEMM that depends on the start's ticket, so
    that it becomes ready together with the finish, in a program padded past the executor's
    sequential threshold: the finish as a blocking handler (as osmm_reduce_finish is) against
    one that returns an ``ffi::Future``. One process, no MPI."""
    _load_async_ffi()
    delay_ms = int(args.delay * 1e3)
    big = args.big
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 512)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((big, big)) / np.sqrt(big), jnp.float32)
    smalls = tuple(jnp.full((64, 64), float(i), jnp.float32) for i in range(args.pad))
    # The GEMM's result is returned whole (an output buffer of its own): a reduction after it
    # would write a scalar into memory the finish's ticket used, and wait for the finish.
    gemms = {
        "ynn": lambda v: v @ v,
        "dot": lambda v: jax.lax.dot_general(v, v, (((0,), (0,)), ((), ()))),
        "ynn+sum": lambda v: (v @ v).sum(),
    }

    def program(finish: str | None, gemm, keep: bool = False):
        def f(x, g, smalls):
            pads = [jnp.sin(s * (i + 1)) for i, s in enumerate(smalls)]
            if finish is None:
                return x, gemm(g), pads
            ticket = jax.ffi.ffi_call(
                "probe_start", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
            )(x, delay_ms=np.int64(delay_ms))
            y = jax.ffi.ffi_call(
                f"probe_finish_{finish}",
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                has_side_effect=True,
            )(x, ticket)
            if gemm is None:
                return y, jnp.float32(0), pads
            result = gemm(jnp.where(ticket < 0, jnp.zeros_like(g), g))
            if keep:
                # The ticket as an output of the program: a buffer of its own that nothing
                # after the finish can be assigned to (no write-after-read edge from it).
                return y, result, pads, ticket
            return y, result, pads

        return jax.jit(f)

    variants = {"finish_only/sync": program("sync", None)}
    for gname, gemm in gemms.items():
        variants[f"gemm_only/{gname}"] = program(None, gemm)
        for finish in ("sync", "async"):
            variants[f"{finish}/{gname}"] = program(finish, gemm)
            variants[f"{finish}/{gname}/ticket_kept"] = program(finish, gemm, keep=True)
    out = os.path.join(args.out, "async")
    os.makedirs(out, exist_ok=True)
    results = {}
    for name, fn in variants.items():
        operands = (x, g, smalls)
        text = fn.lower(*operands).compile().as_text()
        jax.block_until_ready(fn(*operands))
        times = wall_times(fn, operands, args.repeats)
        tag = name.replace("/", "_")
        logdir = os.path.join(out, f"trace_{tag}")
        traced(fn, operands, logdir, 1)
        spans = thunk_spans([e for e in trace_events(logdir) if not e["name"].startswith("$")])
        results[name] = {
            "median": float(np.median(times)),
            "sequence": describe_sequence(text),
            "spans": spans,
        }
        print(f"{name:<26} {np.median(times) * 1e3:7.1f} ms", flush=True)
    with open(os.path.join(out, "async.json"), "w") as f:
        json.dump(results, f, indent=1)


def probe_effects(args) -> None:
    """Two host callbacks that each sleep ``--delay`` seconds and share no data, as
    side-effecting custom calls without a token (``jax.debug.callback(ordered=False)``) and on
    JAX's ordered-effect token chain (``ordered=True``), with and without ``--pad`` independent
    small kernels: whether XLA:CPU runs side-effecting custom calls concurrently."""
    delay = args.delay
    smalls = tuple(jnp.full((64, 64), float(i), jnp.float32) for i in range(args.pad))

    def nap(tag):
        def host(v):
            time.sleep(delay)

        return host

    def program(ordered: bool, pad: bool):
        def f(x, smalls):
            jax.debug.callback(nap("first"), x, ordered=ordered)
            # Its own operand (a parameter), so that both callbacks are ready at the start.
            jax.debug.callback(nap("second"), smalls[-1] if pad else x, ordered=ordered)
            return [jnp.sin(s * (i + 1)) for i, s in enumerate(smalls)] if pad else x

        return jax.jit(f)

    x = jnp.zeros((8,), jnp.float32)
    out = os.path.join(args.out, f"rank{RANK}")
    os.makedirs(out, exist_ok=True)
    results = {}
    for ordered in (False, True):
        for pad in (False, True):
            fn = program(ordered, pad)
            text = fn.lower(x, smalls).compile().as_text()
            jax.block_until_ready(fn(x, smalls))
            jax.effects_barrier()
            times = wall_times(fn, (x, smalls), args.repeats, after=jax.effects_barrier)
            name = f"ordered={ordered} padded={pad}"
            results[name] = {
                "median": float(np.median(times)),
                "custom_calls": re.findall(r"custom-call\(([^)]*)\)", text),
            }
            print(
                f"{name:<28} {np.median(times) * 1e3:7.1f} ms (each callback sleeps "
                f"{delay * 1e3:.0f} ms)",
                flush=True,
            )
    with open(os.path.join(out, "effects.json"), "w") as f:
        json.dump(results, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("blocked", "effects", "async"))
    parser.add_argument("--out", default="/tmp/overlap_experiments")
    parser.add_argument("--n", type=int, default=512, help="C is n x n (blocked)")
    parser.add_argument("--big", type=int, default=2048, help="the independent GEMM (blocked)")
    parser.add_argument(
        "--pad", type=int, default=0, help="independent small kernels added (blocked)"
    )
    parser.add_argument("--delay", type=float, default=0.3, help="rank 1's sleep (blocked)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    {"blocked": probe_blocked, "effects": probe_effects, "async": probe_async}[args.probe](args)


if __name__ == "__main__":
    main()
