"""Time one_sided's two synchronisations against the all-reduce method, in one run per case.

Run under mpiexec (every rank runs it), on this host or across emulated hosts
(``benchmarks.sync_report`` runs it in both)::

    mpiexec -n 3 .venv/bin/python -m benchmarks.sync --cases k_split:64,dp_grad:256,mlp

Entries, interleaved in shuffled rounds (medians of the slowest rank's time, after warm-up):
``notify`` (``sync="notify"``: per-origin slots and notifications, no collective per product),
``fence`` (``sync="fence"``: collective MPI_Win_fence epochs) and ``allreduce`` (the mpi4jax
baseline); where C is replicated (``dp_grad``, ``mlp``, ``lm_dp``) also ``notify staged``: the
notified mode with every replicated C staged (reduce-scatter, then the notified all-gather),
which ``notify`` does only where that saves more than ``slots.DIRECT_EXTRA_ELEMENTS`` elements
per rank (below it, every partial goes to every rank). Cases (``name:size``):

``k_split:n``   C[n x n] = A[n x n] @ B[n x n], A by columns, B and C by rows: every rank's
                partials of every C block reduced onto its owner;
``dp_grad:d``   the weight gradient of a data-parallel layer, dW[d x d] = X.T @ dY over 512
                rows split evenly: summed onto every rank (a replicated C);
``fetch:n``     C[n x n] = A[n x n] @ B[n x n], A and C by rows, B by columns: every rank gets
                the B columns it lacks (pushed by their owners in the notified mode, a fence
                epoch of gets in the fence mode), nothing is delivered;
``mlp``         one jitted SGD step of a 4-layer MLP of :class:`osmm_jax.flax.Dense` (width
                256, 512 rows split evenly), gradients summed by the layers themselves;
``lm_dp``       one data-parallel adam step of the character-level Transformer of
                examples/train_lm.py at its default size (d=96, 4 heads, 2 blocks, 24
                sequences of 64 characters split evenly), stock layers, every gradient
                summed in one fused transfer (``osmm_jax.flax.value_and_grad``); the
                ``allreduce`` entry sums them with ``sum_method="allreduce"`` (what
                DistributedDataParallel does). The first step's loss of each entry must agree.

Rank 0 prints one JSON line per case (``--json`` appends the records to a file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import osmm_jax as om
from benchmarks import common
from benchmarks.common import COMM, RANK, SIZE
from osmm_jax._src.runtime import slots

ROWS = 512
WIDTH = 256
STAGED = "notify staged"
DIRECT_VARIABLE = "OSMM_BENCH_DIRECT_EXTRA_ELEMENTS"
_direct = os.environ.get(DIRECT_VARIABLE)
ONE_SIDED = {
    "notify": ("notify", None if _direct is None else int(_direct)),
    STAGED: ("notify", 0),
    "fence": ("fence", None),
}
"""Each one_sided entry: its synchronisation and the ``slots.DIRECT_EXTRA_ELEMENTS`` it is
traced with (None: the library's). ``OSMM_BENCH_DIRECT_EXTRA_ELEMENTS`` sets the ``notify``
entry's, e.g. a very large value to time a large replicated C summed directly against
``notify staged`` (``sync_report --env OSMM_BENCH_DIRECT_EXTRA_ELEMENTS=...``)."""


def product_case(kind: str, size: int):
    """(plan, a, b, flops) of a ``k_split``, ``fetch`` or ``dp_grad`` case."""
    if kind == "k_split":
        n = size
        layouts = (om.Layout.cols((n, n)), om.Layout.rows((n, n)), om.Layout.rows((n, n)))
        flops = 2 * n**3
    elif kind == "fetch":
        n = size
        layouts = (om.Layout.rows((n, n)), om.Layout.cols((n, n)), om.Layout.rows((n, n)))
        flops = 2 * n**3
    elif kind == "dp_grad":
        d = size
        layouts = (
            om.Layout.cols((d, ROWS)),
            om.Layout.rows((ROWS, d)),
            om.Layout.replicated((d, d)),
        )
        flops = 2 * d * ROWS * d
    else:
        raise ValueError(f"unknown case {kind!r}")
    plan = om.plan(*layouts)
    rng = np.random.default_rng(RANK)
    a = jnp.asarray(rng.standard_normal(plan.a.local_shape(RANK)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(plan.b.local_shape(RANK)), jnp.float32)
    return plan, a, b, flops


def product_entries(kind: str, size: int) -> tuple[dict, float]:
    plan, a, b, flops = product_case(kind, size)
    fns = {}
    for name in _one_sided_entries(plan.c.is_replicated):
        sync, direct = ONE_SIDED[name]
        fn = jax.jit(lambda x, y, s=sync: om.matmul(x, y, plan, sync=s))
        with synchronisation(sync, direct):
            jax.block_until_ready(fn(a, b))  # traced now, with this staging
        fns[name] = (fn, (a, b))
    fns["allreduce"] = (jax.jit(lambda x, y: om.matmul(x, y, plan, method="allreduce")), (a, b))
    fns["floor (local GEMMs only)"] = common.local_floor(plan, jnp.float32)
    return fns, flops


def mlp_step(method: str):
    """A jitted SGD step of the 4-layer MLP and its arguments (traced under the current
    ``OSMM_SYNC``, which the layers' products read)."""
    from osmm_jax.flax import Dense, value_and_grad

    rows = om.split_sizes(ROWS, SIZE)
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = jnp.tanh(Dense(WIDTH, row_sizes=rows, method=method)(x))
            return Dense(WIDTH, row_sizes=rows, method=method)(x)

    model = MLP()
    rng = np.random.default_rng(RANK)
    x = jnp.asarray(rng.standard_normal((rows[RANK], WIDTH)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((rows[RANK], WIDTH)), jnp.float32)
    params = model.init(jax.random.key(0), jnp.zeros((rows[RANK], WIDTH), jnp.float32))

    def loss(p, x, y):
        return jnp.sum((model.apply(p, x) - y) ** 2) / ROWS

    @jax.jit
    def step(p, x, y):
        value, grads = value_and_grad(loss)(p, x, y)
        return value, jax.tree.map(lambda w, g: w - 1e-3 * g, p, grads)

    return step, (params, x, y)


def _one_sided_entries(replicated: bool) -> list[str]:
    """The one_sided entries of a case: ``notify staged`` only where C is replicated."""
    return [name for name in ONE_SIDED if replicated or name != STAGED]


@contextlib.contextmanager
def synchronisation(sync: str, direct_elements: int | None = None):
    """``OSMM_SYNC=sync`` (and both of ``slots.DIRECT_EXTRA_ELEMENTS`` and
    ``slots.DIRECT_EXTRA_ELEMENTS_MESSAGES`` set to ``direct_elements`` unless None) while a
    step is traced (the layers' products read them then); the caller's own values afterwards."""
    names = ("DIRECT_EXTRA_ELEMENTS", "DIRECT_EXTRA_ELEMENTS_MESSAGES")
    before = os.environ.get("OSMM_SYNC"), [getattr(slots, name) for name in names]
    os.environ["OSMM_SYNC"] = sync
    if direct_elements is not None:
        for name in names:
            setattr(slots, name, direct_elements)
    try:
        yield
    finally:
        if before[0] is None:
            os.environ.pop("OSMM_SYNC")
        else:
            os.environ["OSMM_SYNC"] = before[0]
        for name, value in zip(names, before[1]):
            setattr(slots, name, value)


def mlp_entries() -> tuple[dict, float]:
    fns = {}
    for name in _one_sided_entries(True):
        with synchronisation(*ONE_SIDED[name]):
            step, args = mlp_step("one_sided")
            jax.block_until_ready(step(*args))  # traced now, under this synchronisation
        fns[name] = (step, args)
    fns["allreduce"] = mlp_step("allreduce")
    return fns, 3 * 4 * 2 * ROWS * WIDTH * WIDTH


LM = {"d": 96, "heads": 4, "layers": 2, "batch": 24, "context": 64}  # train_lm's defaults


def lm_entries() -> tuple[dict, float]:
    """The ``lm_dp`` case: each entry's step and arguments (see the module docstring)."""
    from benchmarks.lm_step import lm, step_flops

    data, vocab = lm.encode(lm.load_text(200_000))
    x, y = next(lm.batches(data, 1, LM["batch"], LM["context"], 0))
    counts = om.split_sizes(LM["batch"], SIZE)
    mine = slice(sum(counts[:RANK]), sum(counts[: RANK + 1]))
    tokens = LM["batch"] * LM["context"]

    def step(sum_method: str):
        model = lm.GPT(
            vocab,
            LM["context"],
            LM["d"],
            LM["heads"],
            LM["layers"],
            lm.Layers("single"),
            nnx.Rngs(0),
        )
        fn, params, opt_state = lm.make_step(model, 1e-3, tokens, dp=True, sum_method=sum_method)
        args = (params, opt_state, jnp.asarray(x[mine]), jnp.asarray(y[mine]))
        loss = COMM.allreduce(float(fn(*args)[2]))  # traced now, under this synchronisation
        return (fn, args), loss

    fns, losses = {}, {}
    for name in _one_sided_entries(True):
        with synchronisation(*ONE_SIDED[name]):
            fns[name], losses[name] = step("one_sided")
    fns["allreduce"], losses["allreduce"] = step("allreduce")
    if not all(
        abs(v - losses["allreduce"]) <= 1e-5 * abs(losses["allreduce"]) for v in losses.values()
    ):
        raise SystemExit(f"lm_dp: first-step losses disagree: {losses}")
    flops = step_flops(tokens, LM["d"], LM["layers"], LM["context"], vocab)
    return fns, flops


BREAKDOWN_CALLS = 5
COUNTERS = ("fences", "closing_fence_seconds", "notifications", "notify_wait_seconds")


def breakdown(fns: dict) -> dict:
    """Per call of each one_sided entry, on this rank: fences, seconds in closing fences,
    notifications sent and seconds in notified finishes (waiting included), and the wall
    time, from ``BREAKDOWN_CALLS`` more calls after the timed rounds."""
    out = {}
    for sync in (name for name in ONE_SIDED if name in fns):
        fn, args = fns[sync]
        before = om.stats()
        COMM.Barrier()
        start = time.perf_counter()
        for _ in range(BREAKDOWN_CALLS):
            jax.block_until_ready(fn(*args))
        wall = (time.perf_counter() - start) / BREAKDOWN_CALLS
        after = om.stats()
        out[sync] = {k: (after[k] - before[k]) / BREAKDOWN_CALLS for k in COUNTERS}
        out[sync]["wall_seconds"] = wall
    return out


def run(case: str, repeats: int) -> dict:
    kind, _, size = case.partition(":")
    if kind == "mlp":
        fns, flops = mlp_entries()
    elif kind == "lm_dp":
        fns, flops = lm_entries()
    else:
        fns, flops = product_entries(kind, int(size))
    before = om.stats()
    times = common.interleaved_times(fns, repeats)
    after = om.stats()
    per_call = COMM.gather(breakdown(fns))
    entries = common.summarise(times, flops)
    seconds = {e["name"]: e["seconds"] for e in entries}
    return {
        "case": case,
        "ranks": SIZE,
        "binding": common.binding(),
        "entries": entries,
        "notify_vs_allreduce": seconds["allreduce"] / seconds["notify"],
        "fence_vs_allreduce": seconds["allreduce"] / seconds["fence"],
        "notify_vs_fence": seconds["fence"] / seconds["notify"],
        "staged_vs_allreduce": seconds["allreduce"] / seconds[STAGED]
        if STAGED in seconds
        else None,
        "counters": {
            k: after[k] - before[k]
            for k in ("notifications", "deferred_deliveries", "credit_reads", "fences")
        },
        "per_call_by_rank": per_call,
        "environment": {
            k: os.environ[k]
            for k in (
                "MPIR_CVAR_CH4_NETMOD",
                "FI_PROVIDER",
                "MPIR_CVAR_ENABLE_HEAVY_YIELD",
                DIRECT_VARIABLE,
            )
            if k in os.environ
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="notify vs fence vs all-reduce")
    parser.add_argument(
        "--cases", default="k_split:64,k_split:256,dp_grad:64,dp_grad:256,mlp,lm_dp"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="append the records to this JSON list")
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        record = run(case, args.repeats)
        if RANK == 0:
            print(json.dumps(record), flush=True)
            common.save(record, args.json)


if __name__ == "__main__":
    main()
