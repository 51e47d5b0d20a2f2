"""Timelines of a jitted training step's communication against its GEMMs, per rank and thread,
and how much of the communication ran while a GEMM computed.

Subcommands::

    # every rank records (under MPI): the step traced by jax.profiler, one JSON per rank
    .venv/bin/mpiexec -n 3 .venv/bin/python -m benchmarks.step_timeline record \\
        --step lm-tp-sp --out /tmp/timeline/shm3/lm-tp-sp
    # tables and pictures from what was recorded (no MPI)
    .venv/bin/python -m benchmarks.step_timeline report --out /tmp/timeline
    # both, per configuration of benchmarks.overlap_report (root for the emulated hosts)
    .venv/bin/python -m benchmarks.step_timeline run --configs shm3_112,tcp3 \\
        --steps mlp,lm-dp-layers,lm-tp-sp --out /tmp/timeline
    # the same with a setting in every rank (folders <config>+OSMM_DEFER=1)
    .venv/bin/python -m benchmarks.step_timeline run --configs shm3_112 --steps mlp \\
        --setting OSMM_DEFER=1 --out /tmp/timeline

Steps (each as a user writes it, osmm_jax's default settings: deferred finishes across nodes,
fetches ahead where they apply):

* ``mlp``: one SGD step of a 4-layer MLP of ``osmm_jax.flax.Dense`` (``--width`` features,
  ``--batch`` rows split evenly), ``benchmarks.overlap_probe``'s step;
* ``lm-dp-layers``: ``benchmarks.lm_step``'s "osmm DP layers": examples/train_lm.py's GPT, each
  dense layer's weight gradient summed by its own backward product, sequences per rank in
  proportion to the measured speeds;
* ``lm-dp-fused``: the same model with stock layers and one fused sum after the backward pass;
* ``lm-tp``: its tensor parallelism (heads and MLP features per rank by speed, every rank the
  whole batch);
* ``lm-tp-sp``: the same with sequence parallelism between the layer pairs.

What is measured, per rank and traced step, from the thunks' spans (``overlap_probe.thunk_spans``):
*communication* is the time covered by any osmm_jax custom call, from its start to its end,
and by every deferred delivery from its ``osmm_reduce_start_deferred`` to the completion of
the future of its asynchronous finish (the whole time it is in flight); *hidden* is the part of it during which a GEMM thunk ran on any
thread. Where ranks outnumber cores a span includes time its thread was descheduled, so
*hidden* is an upper bound there.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STEPS = ("mlp", "lm-dp-layers", "lm-dp-fused", "lm-tp", "lm-tp-sp")
PROFILER_WARMUP = 2  # traced steps left out of the measurements
IN_FLIGHT = "in flight"  # the timeline's lane of a rank's asynchronous finishes


# -- recording (every rank, under MPI) ---------------------------------------------------------


def build_step(name: str, args):
    """``(step, operands)`` of step ``name`` on this rank."""
    if name == "mlp":
        from benchmarks.overlap_probe import mlp_step

        return mlp_step(args.batch, args.width)
    import jax.numpy as jnp
    from flax import nnx

    import osmm_jax as om
    from benchmarks.common import RANK
    from benchmarks.lm_layers import lm

    batch, context, d, heads, blocks = 48, 128, 256, 8, 2  # benchmarks.lm_step's defaults
    speeds = om.profile_speeds(size=1024, repeats=5, progress=False)
    data, vocab = lm.encode(lm.load_text(200_000))
    x, y = next(lm.batches(data, 1, batch, context, 0))
    weighted = om.balance(batch, speeds, min_rows=1).sizes
    first = sum(weighted[:RANK])
    rows = slice(first, first + weighted[RANK])
    if name == "lm-dp-fused":
        layers = lm.Layers("single")
    elif name == "lm-dp-layers":
        sizes = [s * context for s in weighted]
        layers = lm.Layers("dp", row_sizes=sizes, method="one_sided")
    else:
        layers = lm.Layers(
            "tp",
            head_sizes=om.balance(heads, speeds, min_rows=1).sizes,
            mlp_sizes=om.balance(4 * d, speeds, min_rows=1).sizes,
            method="one_sided",
            batch_sizes=weighted if name == "lm-tp-sp" else None,
        )
    model = lm.GPT(vocab, context, d, heads, blocks, layers, nnx.Rngs(0))
    if name == "lm-tp":  # every rank the whole batch, its own shards
        step, params, opt_state = lm.make_step(model, 3e-3, batch * context)
        return step, (params, opt_state, jnp.asarray(x), jnp.asarray(y))
    step, params, opt_state = lm.make_step(model, 3e-3, batch * context, dp=True)
    return step, (params, opt_state, jnp.asarray(x[rows]), jnp.asarray(y[rows]))


def kinds_of(hlo_text: str) -> dict[str, str]:
    """``{instruction: kind}`` for the entry computation's GEMMs (``"GEMM"``: a dot, or a
    fusion holding one) and osmm_jax custom calls (their target)."""
    from benchmarks.overlap_probe import OSMM_TARGETS, computations_with_dots, entry_sequence

    with_dots = computations_with_dots(hlo_text)
    kinds = {}
    for ins in entry_sequence(hlo_text):
        if ins["opcode"] == "dot" or (ins["opcode"] == "fusion" and ins["calls"] in with_dots):
            kinds[ins["name"]] = "GEMM"
        elif ins["target"] and ins["target"].startswith(OSMM_TARGETS):
            kinds[ins["name"]] = ins["target"]
    return kinds


def deferred_pairs(hlo_text: str) -> dict[str, str]:
    """``{finish: start}``: the ``osmm_reduce_start_deferred`` each asynchronous finish of the
    entry computation collects (found through the ticket it reads)."""
    from benchmarks.overlap_probe import entry_sequence

    sequence = {ins["name"]: ins for ins in entry_sequence(hlo_text)}
    pairs = {}
    for ins in sequence.values():
        if ins["target"] != "osmm_reduce_finish_deferred":
            continue
        todo = list(ins["operands"])
        while todo:
            source = sequence.get(todo.pop())
            if source is None:
                continue
            if source["target"] == "osmm_reduce_start_deferred":
                pairs[ins["name"]] = source["name"]
                break
            if source["opcode"] in ("get-tuple-element", "bitcast", "copy"):
                todo += source["operands"]
    return pairs


def record(args) -> None:
    """Compile, warm up, time ``--repeats`` steps untraced and ``--traced`` under the
    profiler; write ``rank<r>.json`` under ``--out``."""
    import jax

    import osmm_jax as om
    from benchmarks.common import RANK, SIZE
    from benchmarks.overlap_probe import trace_events, traced, wall_times

    step, operands = build_step(args.step, args)
    text = step.lower(*operands).compile().as_text()
    kinds, pairs = kinds_of(text), deferred_pairs(text)
    for _ in range(2):
        jax.block_until_ready(step(*operands))
    seconds = wall_times(step, operands, args.repeats, barrier=True)
    before = om.stats()
    logdir = tempfile.mkdtemp(prefix=f"trace_rank{RANK}_")
    # The first steps under a fresh profiler run several times slower: traced, not kept.
    walls = traced(step, operands, logdir, PROFILER_WARMUP + args.traced)
    jax.effects_barrier()
    after = om.stats()
    events = [e for e in trace_events(logdir) if not e["name"].startswith("$")]
    os.makedirs(args.out, exist_ok=True)
    record = {
        "step": args.step,
        "rank": RANK,
        "size": SIZE,
        "settings": {k: v for k, v in os.environ.items() if k.startswith("OSMM_")},
        "seconds": seconds,
        "walls_ns": walls,
        "kinds": kinds,
        "pairs": pairs,
        "events": events,
        "deferred_reduces": after.get("deferred_reduces", 0) - before.get("deferred_reduces", 0),
    }
    with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {RANK}: {args.step} median {np.median(seconds) * 1e3:.1f} ms", flush=True)


# -- measuring the spans -----------------------------------------------------------------------


def union(intervals) -> list[tuple[float, float]]:
    """The disjoint, sorted union of ``(start, end)`` intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals) -> float:
    return sum(end - start for start, end in union(intervals))


def overlap(a, b) -> float:
    """Length of the intersection of the unions of ``a`` and ``b``."""
    total, ua, ub = 0.0, union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_runs(rec: dict) -> list[list[dict]]:
    """The spans of each traced step of ``rec`` (in order), GEMMs and osmm_jax calls only,
    each with its ``kind``; times in microseconds on the trace clock."""
    from benchmarks.overlap_probe import thunk_spans

    kinds = rec["kinds"]
    spans = [
        dict(s, kind=kinds[s["name"]]) for s in thunk_spans(rec["events"]) if s["name"] in kinds
    ]
    runs = sorted({s["run_id"] for s in spans}, key=int)
    out = []
    for run in runs:
        mine = [s for s in spans if s["run_id"] == run]
        by_name = {s["name"]: s for s in mine}
        for s in mine:
            start = by_name.get(rec.get("pairs", {}).get(s["name"]))
            # A deferred delivery is in flight from its start, not from when XLA got to its
            # finish (which it may place late: nothing waits on it before its consumer).
            s["issued"] = start["start"] if start is not None else s["start"]
        out.append(mine)
    return out


def measure(spans: list[dict]) -> dict:
    """Step span, communication, hidden communication (ms) of one traced step's spans."""
    comm = [(s.get("issued", s["start"]), s["end"]) for s in spans if s["kind"] != "GEMM"]
    gemms = [(s["start"], s["end"]) for s in spans if s["kind"] == "GEMM"]
    step = max(s["end"] for s in spans) - min(s["start"] for s in spans)
    return {
        "step_ms": step / 1e3,
        "comm_ms": covered(comm) / 1e3,
        "hidden_ms": overlap(comm, gemms) / 1e3,
        "gemm_ms": covered(gemms) / 1e3,
    }


# -- reporting (no MPI) ------------------------------------------------------------------------


def aligned_last_run(rec: dict) -> list[dict]:
    """The spans of ``rec``'s last traced step, on the wall clock (us)."""
    from benchmarks.overlap_probe import wall_offset

    runs = step_runs(rec)
    offset = wall_offset(rec["events"], rec["walls_ns"], len(runs) - 1)
    return [
        dict(s, start=s["start"] + offset, end=s["end"] + offset, issued=s["issued"] + offset)
        for s in runs[-1]
    ]


def summarize(folder: str) -> dict | None:
    """Per rank of the recording in ``folder``: medians over its traced steps of
    :func:`measure`, and the untraced step median (ms)."""
    paths = sorted(glob.glob(os.path.join(folder, "rank*.json")))
    if not paths:
        return None
    records = [json.load(open(p)) for p in paths]
    ranks = []
    for rec in records:
        measured = [measure(spans) for spans in step_runs(rec)[PROFILER_WARMUP:] if spans]
        row = {k: float(np.median([m[k] for m in measured])) for k in measured[0]}
        row.update(rank=rec["rank"], untraced_ms=float(np.median(rec["seconds"])) * 1e3)
        row["hidden_fraction"] = row["hidden_ms"] / row["comm_ms"] if row["comm_ms"] else 0.0
        ranks.append(row)
    return {
        "step": records[0]["step"],
        "size": records[0]["size"],
        "records": records,
        "ranks": ranks,
    }


def plot(summary: dict, path: str, title: str) -> None:
    """The last traced step of every rank: one lane per rank and thread, GEMMs blue, osmm_jax
    calls coloured by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"GEMM": "tab:blue", "start": "tab:green", "finish": "tab:red", "other": "tab:purple"}

    def color(kind: str) -> str:
        if kind == "GEMM":
            return colors["GEMM"]
        return (
            colors["start"]
            if "start" in kind
            else colors["finish" if "finish" in kind else "other"]
        )

    def lane(s: dict) -> str:
        # An asynchronous finish holds no thread while it waits: its own lane.
        return IN_FLIGHT if s["kind"] == "osmm_reduce_finish_deferred" else s["thread"]

    per_rank = [(rec["rank"], aligned_last_run(rec)) for rec in summary["records"]]
    origin = min(s["start"] for _, spans in per_rank for s in spans)
    lanes = []
    for rank, spans in per_rank:
        lanes += [(rank, t) for t in dict.fromkeys(lane(s) for s in spans)]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(lanes) + 1.5))
    for rank, spans in per_rank:
        for s in spans:
            y = lanes.index((rank, lane(s)))
            begin = s["issued"] if lane(s) == IN_FLIGHT else s["start"]
            left, width = (begin - origin) / 1e3, max((s["end"] - begin) / 1e3, 0.05)
            alpha = 0.45 if lane(s) == IN_FLIGHT else 1.0
            ax.barh(
                y, width, left=left, color=color(s["kind"]), edgecolor="black", lw=0.2, alpha=alpha
            )
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(
        [f"rank {r} {'in flight' if t == IN_FLIGHT else 'thread'}" for r, t in lanes], fontsize=7
    )
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first thunk on any rank (ranks aligned by wall clock)")
    labels = [
        "GEMM",
        "osmm start",
        "osmm finish (in flight: deferred, start to done)",
        "osmm other",
    ]
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args) -> None:
    """``timeline.md`` (one row per configuration, step and rank) and one PNG per recording,
    under ``--out``, from the folders ``<config>/<step>/`` that :func:`record` filled."""
    lines = [
        "| configuration | step | rank | step (ms, untraced) | traced step (ms) | GEMM (ms) "
        "| communication (ms) | hidden (ms) | hidden fraction |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for folder in sorted(glob.glob(os.path.join(args.out, "*", "*"))):
        summary = summarize(folder)
        if summary is None:
            continue
        config = os.path.basename(os.path.dirname(folder))
        for r in summary["ranks"]:
            lines.append(
                f"| {config} | {summary['step']} | {r['rank']} | {r['untraced_ms']:.1f} "
                f"| {r['step_ms']:.1f} | {r['gemm_ms']:.1f} | {r['comm_ms']:.1f} "
                f"| {r['hidden_ms']:.1f} | {r['hidden_fraction']:.2f} |"
            )
        title = f"{summary['step']} on {summary['size']} ranks ({config}): last traced step"
        plot(summary, os.path.join(args.out, f"{config}_{summary['step']}.png"), title)
    text = "\n".join(lines) + "\n"
    Path(args.out, "timeline.md").write_text(text)
    print(text)


# -- running it per configuration (root for the emulated hosts) --------------------------------


def run(args) -> int:
    """:func:`record` for every step in every configuration (``benchmarks.overlap_report``'s
    configurations), then :func:`report`."""
    from benchmarks.overlap_report import CONFIGS, config_command
    from benchmarks.sync_latency import netns, run_job

    names = args.configs.split(",")
    settings = dict(item.split("=", 1) for item in args.setting)
    suffix = "".join(f"+{k}={v}" for k, v in sorted(settings.items()))
    tcp = [CONFIGS[n].ranks for n in names if CONFIGS[n].tcp]
    if tcp and (reason := netns.unavailable_reason()) is not None:
        print(f"cannot make emulated hosts: {reason}", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(netns.emulated_hosts(max(tcp))) if tcp else None
        for name in names:
            for step in args.steps.split(","):
                out = os.path.abspath(os.path.join(args.out, name + suffix, step))
                program = [sys.executable, "-m", "benchmarks.step_timeline", "record"]
                program += ["--step", step, "--out", out, "--repeats", str(args.repeats)]
                program += ["--traced", str(args.traced)]
                program += ["--batch", str(args.batch), "--width", str(args.width)]
                with tempfile.TemporaryDirectory() as scratch:
                    command, env = config_command(name, program, hosts, Path(scratch), settings)
                    started = time.perf_counter()
                    end = run_job(command, env, 900.0, merge_stderr=True)
                took = time.perf_counter() - started
                print(f"{name} {step}: status {end.status}, {took:.0f} s", flush=True)
                if end.status != 0:
                    print(end.stdout[-3000:], flush=True)
    report(args)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("record", "report", "run"))
    parser.add_argument("--step", choices=STEPS, default="mlp", help="record: which step")
    parser.add_argument("--steps", default=",".join(STEPS), help="run: which steps")
    parser.add_argument("--configs", default="shm3_112,tcp3", help="run: where")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="OSMM_X=V",
        help="run: set this in every rank (repeatable); the folders are named after it",
    )
    parser.add_argument("--out", default="/tmp/step_timeline")
    parser.add_argument("--repeats", type=int, default=5, help="untraced steps timed")
    parser.add_argument("--traced", type=int, default=5, help="steps measured under the profiler")
    parser.add_argument("--batch", type=int, default=1536, help="mlp: global batch rows")
    parser.add_argument("--width", type=int, default=512, help="mlp: features per layer")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    elif args.command == "report":
        report(args)
    else:
        return run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
