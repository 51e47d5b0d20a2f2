"""How dependably :class:`osmm_jax.Rebalancer` answers a real slowdown, and ignores noise.

Run under MPI, e.g.::

    .venv/bin/mpiexec -n 3 .venv/bin/python -m benchmarks.straggler --runs 10 \\
        --json benchmarks/results/straggler.json

Each run builds a fresh Rebalancer (default settings) over ``--rows`` rows per rank and runs
``--steps`` steps of a real jitted GEMM on every rank's rows (``rows x K`` times ``K x K``),
timing each rank's own work as the Rebalancer's docstring asks. In a *slowed* run the last
rank takes ``--factor`` times as long from step ``--slow-at`` on (2x by default): it does its
GEMM that many times (``--how work``), or sleeps for the rest (``--how sleep``, a slower
device: the extra time takes no CPU from ranks that share its cores);
in a *quiet* run nobody slows down. Per run the benchmark records every change of sizes (step,
which ranks shrank) and every rank's step times. Reported, rank 0:

* slowed runs: the steps from the slowdown to the first change that shrinks the slowed rank
  (the target: within 10 steps in at least 9 of 10 runs), and changes that shrink another rank;
* quiet runs: changes of any kind (the target: none).

Timings are only meaningful with nothing else running on the machine; the noise the
Rebalancer must tell from a slowdown is the machine's own (ranks oversubscribing cores).

Rules can be compared offline on the same noise: record raw step times with ``--fixed`` (every
rank keeps its rows), then replay them through a Rebalancer with any settings, one process, no
mpiexec::

    .venv/bin/python -m benchmarks.straggler --replay benchmarks/results/straggler_fixed.json \
        --setting tolerance=0.1 --setting confirm=3

A replay stops each run at its first change of sizes (after it, the recorded times are those
of the old sizes), which is all the targets ask about: whether the first change shrinks the
slowed rank within 10 steps, and whether a quiet run changes at all. So its counts of changes
are at most 1 per run, unlike a live run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import osmm_jax as om
from benchmarks import common
from benchmarks.common import RANK, SIZE


def one_run(args, slowed: bool) -> dict:
    """One run of ``args.steps`` steps; the last rank slowed from ``args.slow_at`` if
    ``slowed``. Returns its changes of sizes and every rank's step times (rank 0's view)."""
    rb = om.Rebalancer(SIZE * args.rows, [1.0] * SIZE, quantum=args.quantum)
    w = jnp.ones((args.k, args.k), jnp.float32)
    dot = jax.jit(jnp.dot)
    changes, times = [], []
    for step in range(args.steps):
        rows = args.rows if args.fixed else rb.sizes[RANK]
        x = jnp.ones((rows, args.k), jnp.float32)
        dot(x, w).block_until_ready()  # compile (new sizes) outside the timed region
        slow = slowed and RANK == SIZE - 1 and step >= args.slow_at
        start = time.perf_counter()
        for _ in range(args.factor if slow and args.how == "work" else 1):
            dot(x, w).block_until_ready()
        if slow and args.how == "sleep":
            time.sleep((args.factor - 1) * (time.perf_counter() - start))
        if rb.observe(time.perf_counter() - start):
            changes.append(
                {
                    "step": step,
                    "shrunk": list(rb.stragglers),
                    "sizes": list(rb.sizes),
                    "why": rb.last_event,
                }
            )
        times.append(list(rb.times))
    return {"slowed": slowed, "changes": changes, "times": times}


def replay_run(times: list[list[float]], rows: int, settings: dict) -> list[dict]:
    """The first change of sizes a fresh Rebalancer (default settings, updated by
    ``settings``) makes on the recorded ``times`` (a list per step of every rank's seconds,
    every rank at ``rows`` rows); [] when it makes none."""
    nranks = len(times[0])
    step_times = iter(times)
    rb = om.Rebalancer(
        nranks * rows,
        [1.0] * nranks,
        nranks=nranks,
        exchange=lambda _: next(step_times),
        **settings,
    )
    for step in range(len(times)):
        if rb.observe(0.0):
            return [{"step": step, "shrunk": list(rb.stragglers), "why": rb.last_event}]
    return []


def replay(paths: list[str], settings: dict) -> dict[str, dict]:
    """Replay every run of the ``--fixed`` records in ``paths`` (:func:`replay_run`) and
    summarise them as :func:`summarise` does, one summary per way of slowing down (``--how``)."""
    runs: dict[tuple, list[dict]] = {}
    for path in paths:
        for record in json.loads(Path(path).read_text()):
            args = record["args"]
            if not args.get("fixed"):
                raise ValueError(f"{path}: replay needs records made with --fixed")
            for run in record["runs"]:
                key = (args["how"], args["factor"], args["slow_at"], len(run["times"][0]))
                changes = replay_run(
                    run["times"], args["rows"], {"quantum": args["quantum"], **settings}
                )
                runs.setdefault(key, []).append({"slowed": run["slowed"], "changes": changes})
    return {
        f"{how} x{factor}, slowed at {slow_at}, {nranks} ranks": summarise(
            group, slow_at, nranks - 1
        )
        for (how, factor, slow_at, nranks), group in runs.items()
    }


def summarise(runs: list[dict], slow_at: int, slowed_rank: int) -> dict:
    """Delays of the slowed runs (None: never acted) and the changes nobody asked for."""
    delays, wrong = [], 0
    for run in (r for r in runs if r["slowed"]):
        acted = [c["step"] for c in run["changes"] if slowed_rank in c["shrunk"]]
        after = [s for s in acted if s >= slow_at]
        delays.append(after[0] - slow_at if after else None)
        wrong += sum(
            1 for c in run["changes"] if c["step"] < slow_at or set(c["shrunk"]) - {slowed_rank}
        )
    quiet_changes = [len(r["changes"]) for r in runs if not r["slowed"]]
    within = sum(1 for d in delays if d is not None and d <= 10)
    return {
        "delays": delays,
        "within_10": f"{within}/{len(delays)}",
        "median_delay": statistics.median([d for d in delays if d is not None] or [float("nan")]),
        "wrong_changes_in_slowed_runs": wrong,
        "changes_in_quiet_runs": quiet_changes,
    }


def _setting(item: str, parser: argparse.ArgumentParser) -> tuple[str, float]:
    """``NAME=VALUE`` of ``--setting`` as (name, number); a usage error otherwise."""
    name, _, value = item.partition("=")
    try:
        return name, json.loads(value)
    except ValueError:
        parser.error(f"--setting wants NAME=NUMBER, e.g. tolerance=0.1; got {item!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="slowed runs (and as many quiet)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slow-at", type=int, default=12)
    parser.add_argument("--factor", type=int, default=2, help="the slowdown")
    parser.add_argument(
        "--how",
        choices=("work", "sleep"),
        default="work",
        help="slow the rank down by repeating its GEMM (its extra work also takes CPU time "
        "from ranks that share its cores) or by sleeping as long again (a slower device)",
    )
    parser.add_argument("--rows", type=int, default=2048, help="rows per rank at the start")
    parser.add_argument("--k", type=int, default=1024, help="the GEMM's inner and outer size")
    parser.add_argument("--quantum", type=int, default=64)
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="keep every rank at --rows rows whatever the Rebalancer decides (raw step times "
        "for replaying other rules offline; its changes are still recorded)",
    )
    parser.add_argument("--json", default=None, help="append the record to this JSON list")
    parser.add_argument(
        "--replay",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no runs: replay the --fixed records in these files through the Rebalancer",
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="with --replay: a Rebalancer setting other than its default (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.replay:
        settings = dict(_setting(item, parser) for item in args.setting)
        summaries = replay(args.replay, settings)
        if RANK == 0:
            for kind, summary in summaries.items():
                print(f"replay ({kind}), settings {settings or 'default'}: {summary}")
        common.save(
            {"title": "straggler replay", "replayed": args.replay, "settings": settings}
            | {"summaries": summaries},
            args.json,
        )
        return
    runs = []
    for i in range(2 * args.runs):
        runs.append(one_run(args, slowed=i % 2 == 0))
    summary = summarise(runs, args.slow_at, SIZE - 1)
    if RANK == 0:
        print(f"{SIZE} ranks, binding {common.binding_cached}: {summary}")
    common.save(
        {"title": "straggler response", "args": vars(args), "summary": summary, "runs": runs},
        args.json,
    )


if __name__ == "__main__":
    main()
