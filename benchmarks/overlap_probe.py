"""What XLA:CPU does with osmm_jax's custom calls inside a jitted training step.

Probes (benchmarks/results/overlap.md says what they found and gives the commands):

``hlo`` (MPI, e.g. 3 ranks)
    Compiles one SGD step of a 4-layer MLP of :class:`osmm_jax.flax.Dense` and writes, per
    rank, the lowered and compiled HLO and the order of its custom calls and GEMMs in the
    entry computation's schedule (``sequence.txt``), with the token each custom call consumes.
    Run with ``TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=thunk_executor=6`` to have the runtime
    print its thunk DAG.
``timeline`` (MPI), then ``plot`` (no MPI)
    The MLP step on every rank under ``jax.profiler.trace``: per-thunk events and the wall
    clock of each traced step (``rank<r>/timeline.json``); ``plot`` turns them into
    ``timeline.txt`` and ``timeline.png`` (ranks aligned by wall clock).
``blocked``, ``effects``, ``async``
    In benchmarks/overlap_experiments.py: whether a blocked finish lets independent GEMMs run,
    whether side-effecting calls run concurrently, and an asynchronous finish.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om
from osmm_jax.flax import Dense

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
OSMM_TARGETS = (
    "osmm_reduce_start",
    "osmm_reduce_issue",
    "osmm_reduce_finish",
    "osmm_fetch",
    "osmm_watch",
    "osmm_allreduce",
)


# -- the MLP step ------------------------------------------------------------------------------


class MLP(nn.Module):
    """``layers`` osmm_jax Dense layers of ``width`` features, tanh between them."""

    row_sizes: tuple[int, ...]
    width: int
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = Dense(self.width, row_sizes=self.row_sizes, name=f"dense{i}")(x)
            if i < self.layers - 1:
                x = jnp.tanh(x)
        return x


def mlp_step(batch: int, width: int, layers: int = 4, lr: float = 1e-3):
    """``(step, args)``: one jitted SGD step of the MLP on this rank's rows (even split)."""
    sizes = tuple(batch // SIZE + (r < batch % SIZE) for r in range(SIZE))
    model = MLP(row_sizes=sizes, width=width, layers=layers)
    rng = np.random.default_rng(RANK)
    x = jnp.asarray(rng.standard_normal((sizes[RANK], width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((sizes[RANK], width)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.sum((model.apply(params, x) - y) ** 2) / batch

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return value, jax.tree.map(lambda p, g: p - lr * g, params, grads)

    return step, (params, x, y)


# -- reading the compiled HLO ------------------------------------------------------------------


_INSTR = re.compile(r"^\s*(ROOT\s+)?(%?[\w.\-]+)\s*=\s*(.*?)\s(\w[\w\-]*)\((.*)$")


def entry_sequence(hlo_text: str) -> list[dict]:
    """The instructions of the compiled module's entry computation in schedule order (the
    module is ``is_scheduled=true``: the order of the text is XLA's sequence), each with its
    name, opcode, custom-call target (if any), operands and shape."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    out = []
    for line in lines[start + 1 :]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.group(2).lstrip("%"), m.group(3), m.group(4), m.group(5)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0] if ")," in rest else rest)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        out.append(
            {
                "name": name,
                "opcode": opcode,
                "target": target.group(1) if target else None,
                "shape": shape,
                "operands": operands,
                "calls": calls.group(1) if calls else None,
            }
        )
    return out


def computations_with_dots(hlo_text: str) -> set[str]:
    """Names of the computations (fusions) that contain a dot."""
    found, current = set(), None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%([\w.\-]+)\s", line)
        if head and line.rstrip().endswith("{"):
            current = head.group(1)
        elif line.startswith("}"):
            current = None
        elif current and re.search(r"\sdot\(", line):
            found.add(current)
    return found


def describe_sequence(hlo_text: str) -> list[str]:
    """One line per custom call and dot of the entry computation, in schedule order."""
    seq = entry_sequence(hlo_text)
    with_dots = computations_with_dots(hlo_text)
    tokens = {}  # name of a token-producing instruction -> label
    lines = []
    for index, ins in enumerate(seq):
        is_osmm = ins["target"] in OSMM_TARGETS
        is_dot = ins["opcode"] == "dot" or (ins["opcode"] == "fusion" and ins["calls"] in with_dots)
        if ins["opcode"] == "get-tuple-element" and ins["operands"]:
            src = ins["operands"][0]
            if src in tokens and "token[]" in ins["shape"]:
                tokens[ins["name"]] = tokens[src]
            continue
        if ins["opcode"] in ("after-all", "parameter") and "token" in ins["shape"]:
            tokens[ins["name"]] = f"{ins['opcode']}:{ins['name']}"
        if not (is_osmm or is_dot or ins["opcode"] == "custom-call"):
            continue
        label = ins["target"] or (
            "dot" if ins["opcode"] == "dot" else f"fusion(dot):{ins['calls']}"
        )
        token_in = [tokens[o] for o in ins["operands"] if o in tokens]
        if is_osmm or ins["opcode"] == "custom-call":
            tokens[ins["name"]] = f"{label}#{index}"
        shape = re.sub(r"\{[^}]*\}", "", ins["shape"])
        lines.append(
            f"{index:4d} {label:<28} {ins['name']:<32} {shape:<40} token_in={token_in or '-'}"
        )
    return lines


# -- per-thunk timing from the profiler --------------------------------------------------------


def trace_events(logdir: str) -> list[dict]:
    """The complete events ("ph": "X") of the newest trace written under ``logdir``, as
    dicts with name, ts (us), dur (us), tid, pid; read from the .trace.json.gz that
    ``jax.profiler`` writes with ``create_perfetto_trace=True``."""
    import glob
    import gzip

    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    out = []
    for e in events:
        if e.get("ph") == "X":
            out.append(
                {
                    "name": e["name"],
                    "ts": float(e["ts"]),
                    "dur": float(e.get("dur", 0.0)),
                    "tid": e["tid"],
                    "thread": threads.get((e["pid"], e["tid"]), str(e["tid"])),
                    "run_id": (e.get("args") or {}).get("run_id"),
                }
            )
    return out


def traced(fn, args, logdir: str, repeats: int):
    """Run ``fn(*args)`` ``repeats`` times under the profiler, each after a barrier; the wall
    span of each run (``time.time_ns()`` before the call and after its result is ready)."""
    spans = []
    jax.profiler.start_trace(logdir, create_perfetto_trace=True)
    for _ in range(repeats):
        COMM.Barrier()
        t0 = time.time_ns()  # CLOCK_REALTIME: the same clock on every rank of this machine
        jax.block_until_ready(fn(*args))
        spans.append((t0, time.time_ns()))
    jax.profiler.stop_trace()
    return spans


# -- probes ------------------------------------------------------------------------------------


def wall_times(fn, operands, repeats: int, barrier: bool = False, after=None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn(*operands)`` to their results, each after a barrier
    of every rank (``barrier``) and, inside the timing, followed by ``after()`` if given."""
    times = []
    for _ in range(repeats):
        if barrier:
            COMM.Barrier()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*operands))
        if after is not None:
            after()
        times.append(time.perf_counter() - t0)
    return times


def probe_hlo(args) -> None:
    step, step_args = mlp_step(args.batch, args.width)
    lowered = step.lower(*step_args)
    compiled = lowered.compile()
    text = compiled.as_text()
    out = os.path.join(args.out, f"rank{RANK}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "stablehlo.txt"), "w") as f:
        f.write(lowered.as_text())
    with open(os.path.join(out, "compiled_hlo.txt"), "w") as f:
        f.write(text)
    lines = describe_sequence(text)
    with open(os.path.join(out, "sequence.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    # Run it once too, so that the runtime's thunk executor is built (its VLOG, if enabled).
    jax.block_until_ready(step(*step_args))
    jax.effects_barrier()
    COMM.Barrier()
    if RANK == 0:
        print("\n".join(lines))


def gemm_labels(hlo_text: str) -> dict[str, str]:
    """``{instruction: label}`` for the GEMMs of the entry computation (dots and fusions that
    hold a dot): ``dense<i> fwd``, ``dense<i> dW`` (the kernel and bias gradient, this rank's
    partial) or ``dense<i> dX``, from the layer name in the instruction's metadata."""
    with_dots = computations_with_dots(hlo_text)
    labels = {}
    for line in hlo_text[hlo_text.index("ENTRY") :].splitlines()[1:]:
        m = re.match(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\S+) (dot|fusion)\(", line)
        if not m:
            continue
        calls = re.search(r"calls=%([\w.\-]+)", line)
        if m.group(3) == "fusion" and not (calls and calls.group(1) in with_dots):
            continue
        layer = re.search(r"(dense\d+)/dot_general", line)
        where = layer.group(1) if layer else "?"
        if "transpose(" not in line:
            labels[m.group(1)] = f"{where} fwd"
        else:
            rows = re.match(r"f32\[(\d+),", m.group(2))
            # The kernel gradient has the bias row appended: K + 1 rows.
            labels[m.group(1)] = f"{where} dW" if rows and int(rows.group(1)) % 2 else f"{where} dX"
    return labels


def probe_timeline(args) -> None:
    step, step_args = mlp_step(args.batch, args.width)
    text = step.lower(*step_args).compile().as_text()
    jax.block_until_ready(step(*step_args))
    jax.effects_barrier()
    out = os.path.join(args.out, f"rank{RANK}")
    os.makedirs(out, exist_ok=True)
    before = om.stats()
    times = wall_times(step, step_args, args.repeats, barrier=True)
    jax.effects_barrier()
    after = om.stats()
    logdir = os.path.join(out, "trace_step")
    walls = traced(step, step_args, logdir, args.traced)
    events = [e for e in trace_events(logdir) if not e["name"].startswith("$")]
    with open(os.path.join(out, "timeline.json"), "w") as f:
        json.dump(
            {
                "rank": RANK,
                "size": SIZE,
                "batch": args.batch,
                "width": args.width,
                "seconds": times,
                "walls_ns": walls,
                "gemms": gemm_labels(text),
                "sequence": describe_sequence(text),
                "events": events,
                "stats_delta": {
                    k: after[k] - before.get(k, 0)
                    for k in after
                    if isinstance(after[k], (int, float))
                },
            },
            f,
        )
    print(f"rank {RANK}: step median {np.median(times) * 1e3:.1f} ms", flush=True)


# -- turning traces into spans -----------------------------------------------------------------


def thunk_spans(events: list[dict]) -> list[dict]:
    """Per thunk execution: name, thread, start and end (us, trace clock), run_id.

    The runtime records, per thunk, an event over its ``Execute`` call (the whole work of a
    synchronous thunk: custom calls, YNN fusions, kernels run inline) and an ``end: <name>``
    event when its completion is processed. For an asynchronous thunk (a DotThunk's Eigen
    contraction, a kernel split over the intra-op pool) that completion runs on the pool
    thread that finished the work, and the thunks it makes ready run there first (the end
    event is logged after them), so its end is taken where that thread resumed the executor
    (approximate: the last "ThunkExecutor::Execute" event there before the end event)."""
    starts = [e for e in events if e.get("run_id") is not None]
    ends = {}
    for e in events:
        if e["name"].startswith("end: "):
            ends.setdefault(e["name"][5:], []).append(e)
    by_thread = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    for lst in by_thread.values():
        lst.sort(key=lambda e: e["ts"])
    spans = []
    for p in sorted(starts, key=lambda e: e["ts"]):
        launched = p["ts"] + p["dur"]
        candidates = [e for e in ends.get(p["name"], []) if e["ts"] >= p["ts"]]
        end_event = min(candidates, key=lambda e: e["ts"]) if candidates else None
        end = launched
        if end_event is not None and end_event["ts"] > launched + 20.0:
            # The continuation opens with a "ThunkExecutor::Execute" event when it has ready
            # thunks to run; otherwise the end event itself marks the completion.
            resumed = [
                e["ts"]
                for e in by_thread[end_event["tid"]]
                if launched <= e["ts"] <= end_event["ts"] and e["name"] == "ThunkExecutor::Execute"
            ]
            end = max(resumed) if resumed else end_event["ts"]
        spans.append(
            {
                "name": p["name"],
                "thread": p["thread"],
                "tid": p["tid"],
                "start": p["ts"],
                "end": end,
                "run_id": p["run_id"],
            }
        )
    return spans


def wall_offset(events: list[dict], walls_ns: list, index: int) -> float:
    """What to add to the trace clock (us) of traced step ``index`` to put it on the wall
    clock: each traced step (:func:`traced`) began right after a barrier, with
    ``time.time_ns()`` read just before the call whose first ``PjitFunction(...)`` event
    opens it."""
    anchors = []
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["name"].startswith("PjitFunction(") and (not anchors or e["ts"] - anchors[-1] > 1e3):
            anchors.append(e["ts"])
    return walls_ns[index][0] / 1e3 - anchors[index]


def kind_of(name: str, gemms: dict) -> str:
    if name.startswith("osmm_"):
        return name.split(".")[0]
    if name in gemms:
        return "GEMM"
    return "other"


def plot(args) -> None:
    """The timeline of the last traced MLP step on every rank (``timeline`` output): a text
    table (timeline.txt) and a PNG (timeline.png) under ``--out``."""
    import glob

    records = [
        json.load(open(p))
        for p in sorted(glob.glob(os.path.join(args.out, "rank*", "timeline.json")))
    ]
    lines, rows = [], []
    # One time base for all ranks: each traced step began right after a barrier, with
    # time.time_ns() read just before the call whose "PjitFunction(step)" event opens it.
    shifted = []
    for rec in records:
        spans = thunk_spans(rec["events"])
        runs = sorted({s["run_id"] for s in spans}, key=lambda r: int(r))
        run = runs[args.run]
        offset = wall_offset(rec["events"], rec["walls_ns"], runs.index(run))
        spans = [
            dict(s, start=s["start"] + offset, end=s["end"] + offset)
            for s in spans
            if s["run_id"] == run
        ]
        shifted.append((rec, runs, run, spans))
    origin = min(min(s["start"] for s in spans) for *_, spans in shifted)
    for rec, runs, run, spans in shifted:
        t0 = origin
        threads = {}
        for s in sorted(spans, key=lambda s: s["start"]):
            threads.setdefault(s["thread"], f"T{len(threads)}")
        lines.append(
            f"rank {rec['rank']} (run {runs.index(run)} of {len(runs)} traced; step medians "
            f"untraced {np.median(rec['seconds']) * 1e3:.0f} ms); threads: "
            + ", ".join(f"{v}={k}" for k, v in threads.items())
        )
        lines.append(f"  {'start':>8} {'end':>8} {'ms':>7}  thr  thunk")
        for s in sorted(spans, key=lambda s: s["start"]):
            kind = kind_of(s["name"], rec["gemms"])
            if kind == "other":
                continue
            label = rec["gemms"].get(s["name"], "")
            lines.append(
                f"  {(s['start'] - t0) / 1e3:8.2f} {(s['end'] - t0) / 1e3:8.2f} "
                f"{(s['end'] - s['start']) / 1e3:7.2f}  {threads[s['thread']]:>3}  "
                f"{s['name']} {label}"
            )
            rows.append((rec["rank"], threads[s["thread"]], kind, label, s, t0))
        lines.append("")
    lines.append("Per traced step: time in osmm_reduce_finish, and GEMM time on other threads")
    lines.append("inside those finishes (what ran while a finish waited), per rank, ms:")
    for rec in records:
        spans = thunk_spans(rec["events"])
        cells = []
        for run in sorted({s["run_id"] for s in spans}, key=lambda r: int(r)):
            mine = [s for s in spans if s["run_id"] == run]
            finishes = [s for s in mine if s["name"].startswith("osmm_reduce_finish")]
            gemms = [s for s in mine if s["name"] in rec["gemms"]]
            waited = sum(f["end"] - f["start"] for f in finishes)
            inside = sum(
                max(0.0, min(f["end"], g["end"]) - max(f["start"], g["start"]))
                for f in finishes
                for g in gemms
                if g["tid"] != f["tid"]
            )
            step = max(s["end"] for s in mine) - min(s["start"] for s in mine)
            cells.append(f"{waited / 1e3:5.1f} / {inside / 1e3:4.1f} (step {step / 1e3:5.1f})")
        lines.append(f"  rank {rec['rank']}: " + "   ".join(cells))
    lines.append("")
    with open(os.path.join(args.out, "timeline.txt"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "osmm_reduce_start": "tab:green",
        "osmm_reduce_issue": "tab:olive",
        "osmm_reduce_finish": "tab:red",
        "osmm_fetch": "tab:purple",
        "GEMM": "tab:blue",
    }
    lanes = sorted({(r, t) for r, t, *_ in rows})
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.5))
    for rank, thread, kind, label, s, t0 in rows:
        y = lanes.index((rank, thread))
        start, width = (s["start"] - t0) / 1e3, max((s["end"] - s["start"]) / 1e3, 0.05)
        ax.barh(y, width, left=start, color=colors.get(kind, "grey"), edgecolor="black", lw=0.3)
        if width > 1.5:
            text = label or s["name"].replace("osmm_reduce_", "").split(".")[0]
            ax.text(start + width / 2, y, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} {t}" for r, t in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first thunk of the step on any rank (ranks aligned by wall clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="lower right", fontsize=7)
    rec = records[0]
    ax.set_title(
        f"SGD step, 4 x osmm_jax.flax.Dense({rec['width']}), batch {rec['batch']}, "
        f"{rec['size']} ranks: thunks per thread (jax.profiler)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "timeline.png"), dpi=130)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("probe", choices=("hlo", "timeline", "plot"))
    parser.add_argument("--out", default="/tmp/overlap_probe")
    parser.add_argument("--batch", type=int, default=1536, help="global batch rows (MLP)")
    parser.add_argument("--width", type=int, default=512, help="features of every layer (MLP)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--traced", type=int, default=3, help="steps run under the profiler")
    parser.add_argument("--run", type=int, default=-1, help="which traced step to plot")
    args = parser.parse_args(argv)
    {
        "hlo": probe_hlo,
        "timeline": probe_timeline,
        "plot": plot,
    }[args.probe](args)


if __name__ == "__main__":
    main()
