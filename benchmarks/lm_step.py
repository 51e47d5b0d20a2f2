"""Time one train step of the character-level Transformer (examples/train_lm.py) on ranks of
unequal speed: speed-weighted osmm_jax data and tensor parallelism against an even split with
an all-reduce and against JAX's own sharding, and against the aggregate limit.

Run with heterogeneous ranks (ranks 0 and 1 share core 0, rank 2 has core 1 alone)::

    .venv/bin/mpiexec -n 3 -bind-to user:0,0,1 .venv/bin/python -m benchmarks.lm_step \\
        --json benchmarks/results/lm_step.json

The step is train_lm's own (``make_step``: forward, backward and an adam update in one
``jax.jit``), on one batch of ``--batch`` sequences of ``--context`` characters, every rank
starting from the same parameters. Timed side by side in the same run (interleaved in shuffled
rounds, a barrier before each step, the slowest rank's time; medians after one checked call and
one warm-up call each):

* ``osmm DP, speed-weighted (one fused sum)``: the stock model (no osmm_jax layer; dense
  layers on the 2-D view of their input, ``train_lm.StockLinear``) on sequences per rank in
  proportion to the measured GEMM rates (``osmm_jax.balance``), every gradient summed by
  ``osmm_jax.flax.value_and_grad`` in one fused one_sided transfer after the backward pass;
* ``osmm DP layers, speed-weighted (one_sided)``: train_lm's ``dp`` mode, the same sequences,
  each dense layer's weight gradient summed by its own backward product (``osmm_jax.flax.Linear``)
  and the rest in one fused transfer;
* ``osmm TP, speed-weighted (one_sided)``: ``tp`` mode, heads and MLP hidden features per rank
  in proportion to the same rates;
* ``osmm TP + sequence parallel, speed-weighted (one_sided)``: ``sp`` mode, the same shards,
  and between the layer pairs each rank's own sequences (the DP split) instead of all of them;
* ``osmm TP + sequence parallel, gathered rows kept (keep_fetched)``: the same with the column
  layers' ``keep_fetched``: what a rank gathered in the forward pass (the other ranks'
  sequences, and kernel columns where the plan moves them) is kept for the backward pass
  instead of gathered again;
* ``all-reduce DP, even (one fused all-reduce)``: the stock model on equal sequences per rank,
  every gradient summed in one flat all-reduce (mpi4jax), what DistributedDataParallel does;
* ``JAX NamedSharding DP, even``: ``jax`` mode (equal sequences, replicated parameters, JAX's
  gradient all-reduce over gloo);
* ``JAX NamedSharding TP, even``: JAX's own tensor parallelism (XLA's SPMD partitioner over
  gloo) with Megatron's split: the column layers (qkv, MLP up) by output features, the row
  layers (attention projection, MLP down) by input features, the rest and the batch
  replicated. JAX splits a dimension only into equal parts, so each pair's inner width is
  padded with zeros to whole heads (features) per rank (:class:`EvenShardLayers`), as its users
  do where the rank count does not divide the heads;
* ``no-communication floor (speed-weighted rows)``: every rank runs the stock model on its
  ``dp`` sequences alone, nothing summed (the split's own imbalance, without communication);
* ``no-communication floor (even rows)``: the same on the even split; its ratio to the
  speed-weighted floor is what speed-weighting can gain over an even split on these ranks;
* ``no-communication floor (TP shards)``: every rank runs the model cut to its TP shards
  (its heads and MLP hidden features, stock layers) on the whole batch, nothing summed: the
  part of the TP step that no communication scheme can remove, since the embeddings,
  LayerNorms, residual sums and output projection run on every rank;
* with ``--meetings``, ``osmm DP fused, a meeting of the ranks per dense layer``: the fused DP
  step with every dense layer's input passed through ``overlap_step.rendezvous``, so that
  each layer's backward waits for every rank as a per-layer sum would, without summing its
  bytes: what the per-layer sums' synchronisation costs by itself;
* ``no-communication floor (TP shards, sequences between the pairs)``: the TP + SP step
  without communication: each rank's shards, its own sequences between the pairs, a column
  layer's input repeated from them to the whole batch where the gather would be, a row
  layer's output cut to them where the reduce-scatter would be
  (:class:`SequenceShardLayers`);
* ``one process, whole batch (every rank at once)``: every rank runs the stock model on the
  whole batch by itself, at the same time as the others (so ranks sharing a core share it as
  they do in the distributed steps); its row is the slowest rank's time, and each rank's own
  median ``T_r`` gives the aggregate limit.

Aggregate limit: ``L = 1 / sum_r (1 / T_r)`` seconds, the step time if the whole step's work
were split over the ranks in proportion to each rank's measured rate for this very step
(``1 / T_r`` steps per second) with no communication at all; equivalently
``T_r / sum_i (T_r / T_i)`` for any rank r: one rank's time for the whole step divided by the
sum of the speed ratios. (``aggregate_limit_gemm_s`` is the same with the ratios taken from the
GEMM rates instead: fastest rank's ``T`` times its rate over the sum of the rates.)

Before timing, each step's first loss is checked against the one-process loss (float32
tolerance); a mismatch stops the run. Rank 0 prints the table and writes ``lm_step.md`` (date,
machine, binding, load average, the table, the ratios to the targets) and ``lm_step.png`` into
``--out``; ``--json`` appends the raw record. The default size (d=256, 2 blocks, 48 sequences
of 128 characters, about 64 GFLOP per step) is where arithmetic dominates the step on this
project's 2-core machine; at train_lm's default size communication does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import osmm_jax as om
from benchmarks import common
from benchmarks.common import COMM, RANK, SIZE
from benchmarks.lm_layers import (
    EvenShardLayers,
    MeetingLayers,
    SequenceShardLayers,
    ShardLayers,
    lm,
    megatron_spec,
)

RTOL, ATOL = 1e-4, 1e-5  # first-step loss against one process, as train_lm --check
LEARNING_RATE = 3e-3
WARMUP = 1  # warm-up calls per step after the checked (compiling) call

DP = "osmm DP, speed-weighted (one fused sum)"
LAYERS = "osmm DP layers, speed-weighted (one_sided)"
TP = "osmm TP, speed-weighted (one_sided)"
SP = "osmm TP + sequence parallel, speed-weighted (one_sided)"
SP_AHEAD = "osmm TP + sequence parallel, fetch ahead (OSMM_FETCH_AHEAD=1)"
SP_IN_PLACE = "osmm TP + sequence parallel, fetch in place (OSMM_FETCH_AHEAD=0)"
SP_KEEP = "osmm TP + sequence parallel, gathered rows kept (keep_fetched)"
FETCH_AHEAD = {SP_AHEAD: "1", SP_IN_PLACE: "0"}  # the setting each of these is compiled with
EVEN = "all-reduce DP, even (one fused all-reduce)"
JAX = "JAX NamedSharding DP, even"
JAX_TP = "JAX NamedSharding TP, even"
FLOOR = "no-communication floor (speed-weighted rows)"
EVEN_FLOOR = "no-communication floor (even rows)"
TP_FLOOR = "no-communication floor (TP shards)"
SP_FLOOR = "no-communication floor (TP shards, sequences between the pairs)"
ALONE = "one process, whole batch (every rank at once)"
MEETINGS = "osmm DP fused, a meeting of the ranks per dense layer (--meetings)"

# (target, the key of its time ratio in the record's ratios, ">=" or "<=", bound)
TARGETS = [
    ("even all-reduce DP ÷ speed-weighted DP", "even_allreduce_over_dp", ">=", 1.2),
    ("speed-weighted DP ÷ aggregate limit", "dp_over_limit", "<=", 1.15),
    ("even all-reduce DP ÷ speed-weighted DP layers", "even_allreduce_over_layers", ">=", 1.2),
    ("speed-weighted DP layers ÷ aggregate limit", "layers_over_limit", "<=", 1.15),
    ("even all-reduce DP ÷ speed-weighted TP", "even_allreduce_over_tp", ">=", 1.2),
    ("speed-weighted TP ÷ aggregate limit", "tp_over_limit", "<=", 1.15),
    ("speed-weighted TP + sequence parallel ÷ aggregate limit", "sp_over_limit", "<=", 1.15),
    (
        "TP + sequence parallel, gathered rows kept ÷ aggregate limit",
        "sp_keep_over_limit",
        "<=",
        1.15,
    ),
]


def step_flops(tokens: int, d: int, n_layers: int, context: int, vocab: int) -> float:
    """Model FLOPs of one train step: 3x the forward products (forward, and the two backward
    products of each); per token and block 24·d² (q, k, v, projection, MLP 4·d) and 4·context·d
    (attention scores and weighted sum, whole square), plus 2·d·vocab for the output layer."""
    forward = n_layers * (24 * d * d + 4 * context * d) + 2 * d * vocab
    return 3.0 * tokens * forward


def _rows(sizes) -> slice:
    first = sum(sizes[:RANK])
    return slice(first, first + sizes[RANK])


def _own_times(fn, into: list):
    """``fn``, also appending this rank's own seconds per call to ``into``."""

    def run(*args):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        into.append(time.perf_counter() - start)
        return out

    return run


@contextlib.contextmanager
def _setting(name: str, value: str | None):
    """Environment variable ``name`` set to ``value`` inside (untouched for None): a step
    reads osmm_jax's settings when it is compiled, at its first call."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and old is None:
            del os.environ[name]
        elif value is not None:
            os.environ[name] = old


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=48, help="sequences per step (default 48)")
    parser.add_argument("--context", type=int, default=128, help="characters per sequence")
    parser.add_argument("--d", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--layers", type=int, default=2, help="Transformer blocks (default 2)")
    parser.add_argument("--chars", type=int, default=200_000, help="at most this much text")
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--label", default="lm_step", help="the case's name in the record")
    parser.add_argument("--json", help="append the raw record to this JSON file (rank 0)")
    parser.add_argument(
        "--meetings",
        action="store_true",
        help=f"also time {MEETINGS!r}: what one sum per layer costs in synchronisation alone",
    )
    parser.add_argument(
        "--out",
        default=str(common.RESULTS_DIR),
        help="folder for lm_step.md and lm_step.png (default benchmarks/results)",
    )
    args = parser.parse_args(argv)
    if args.batch % SIZE or args.batch < SIZE:
        parser.error(f"--batch must be a positive multiple of the number of ranks ({SIZE})")
    if args.heads < SIZE or args.d % args.heads:
        parser.error(f"--heads must be at least {SIZE} and divide --d")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    started = time.time()
    load_start = os.getloadavg()
    mesh = lm.start_jax_sharding()  # before JAX computes anything
    speeds = om.profile_speeds(size=1024, repeats=5, progress=False)
    rss_start = common.peak_rss_mib()

    data, vocab = lm.encode(lm.load_text(args.chars))
    x, y = next(lm.batches(data, 1, args.batch, args.context, 0))
    tokens = args.batch * args.context

    def build(layers):
        return lm.GPT(vocab, args.context, args.d, args.heads, args.layers, layers, nnx.Rngs(0))

    def step_on(rows, layers=None, *, dp=False, sum_method=None):
        """A step of the model with ``layers`` (stock ones by default) on sequences ``rows``."""
        model = build(layers or lm.Layers("single"))
        step, params, opt_state = lm.make_step(
            model, LEARNING_RATE, tokens, dp=dp, sum_method=sum_method
        )
        return step, (params, opt_state, jnp.asarray(x[rows]), jnp.asarray(y[rows]))

    def layers_step(sizes, method):
        layers = lm.Layers("dp", row_sizes=[s * args.context for s in sizes], method=method)
        return step_on(_rows(sizes), layers, dp=True)

    weighted = om.balance(args.batch, speeds, min_rows=1).sizes
    even = [args.batch // SIZE] * SIZE
    heads = om.balance(args.heads, speeds, min_rows=1).sizes
    hidden = om.balance(4 * args.d, speeds, min_rows=1).sizes
    tp_layers = lm.Layers("tp", head_sizes=heads, mlp_sizes=hidden, method="one_sided")
    sp_layers = lm.Layers(
        "tp", head_sizes=heads, mlp_sizes=hidden, method="one_sided", batch_sizes=weighted
    )
    sp_keep_layers = lm.Layers(
        "tp",
        head_sizes=heads,
        mlp_sizes=hidden,
        method="one_sided",
        batch_sizes=weighted,
        keep_fetched=True,
    )
    tp_step, tp_params, tp_opt = lm.make_step(build(tp_layers), LEARNING_RATE, tokens)
    jax_step, jax_params, jax_opt = lm.make_step(
        build(lm.Layers("single")), LEARNING_RATE, tokens, mesh=mesh
    )
    jax_tp_step, jax_tp_params, jax_tp_opt = lm.make_step(
        build(EvenShardLayers(SIZE, args.heads, args.d)),
        LEARNING_RATE,
        tokens,
        mesh=mesh,
        specs=megatron_spec,
    )
    whole = [common.global_array(v.shape, P(), mesh, jnp.asarray(v)) for v in (x, y)]
    fns = {
        DP: step_on(_rows(weighted), dp=True, sum_method="one_sided"),
        LAYERS: layers_step(weighted, "one_sided"),
        TP: (tp_step, (tp_params, tp_opt, jnp.asarray(x), jnp.asarray(y))),
        SP: step_on(_rows(weighted), sp_layers, dp=True),
        SP_AHEAD: step_on(_rows(weighted), sp_layers, dp=True),
        SP_IN_PLACE: step_on(_rows(weighted), sp_layers, dp=True),
        SP_KEEP: step_on(_rows(weighted), sp_keep_layers, dp=True),
        EVEN: step_on(_rows(even), dp=True, sum_method="allreduce"),
        JAX: (
            jax_step,
            (jax_params, jax_opt, lm.shard_batch(x, mesh), lm.shard_batch(y, mesh)),
        ),
        JAX_TP: (jax_tp_step, (jax_tp_params, jax_tp_opt, *whole)),
        FLOOR: step_on(_rows(weighted)),
        EVEN_FLOOR: step_on(_rows(even)),
        TP_FLOOR: step_on(slice(None), ShardLayers("tp", head_sizes=heads, mlp_sizes=hidden)),
        SP_FLOOR: step_on(
            _rows(weighted),
            SequenceShardLayers("tp", head_sizes=heads, mlp_sizes=hidden, batch_sizes=weighted),
        ),
        ALONE: step_on(slice(None)),
    }
    if args.meetings:
        fns[MEETINGS] = step_on(_rows(weighted), MeetingLayers(), dp=True, sum_method="one_sided")

    # The first call of each step compiles it; its loss is checked against one process's.
    losses = {}
    for name, (fn, fn_args) in fns.items():
        with _setting("OSMM_FETCH_AHEAD", FETCH_AHEAD.get(name)):
            loss = jax.device_get(fn(*fn_args)[2].addressable_data(0))
        summed = name in (DP, LAYERS, SP, SP_AHEAD, SP_IN_PLACE, SP_KEEP, EVEN, MEETINGS)
        losses[name] = float(COMM.allreduce(float(loss)) if summed else loss)
    reference = losses[ALONE]
    wrong = [
        name
        for name in (
            DP,
            LAYERS,
            TP,
            SP,
            SP_AHEAD,
            SP_IN_PLACE,
            SP_KEEP,
            EVEN,
            JAX,
            JAX_TP,
            MEETINGS,
        )
        if name in losses and not abs(losses[name] - reference) <= RTOL * abs(reference) + ATOL
    ]
    if wrong:
        if RANK == 0:
            print(f"first-step loss differs from one process's ({reference:.6f}): ", end="")
            print(", ".join(f"{n}: {losses[n]:.6f}" for n in wrong), flush=True)
        return 1

    own = []
    fns[ALONE] = (_own_times(fns[ALONE][0], own), fns[ALONE][1])
    times = common.interleaved_times(fns, args.repeats, warmup=WARMUP)
    alone = COMM.allgather(float(np.median(own[WARMUP:])))
    limit = 1.0 / sum(1.0 / t for t in alone)
    fastest = int(np.argmax(speeds))
    limit_gemm = alone[fastest] * speeds[fastest] / float(np.sum(speeds))

    flops = step_flops(tokens, args.d, args.layers, args.context, vocab)
    entries = common.summarise(times, flops)
    for e in entries:
        e["tokens_per_s"] = tokens / e["seconds"]
    seconds = {e["name"]: e["seconds"] for e in entries}
    ratios = {
        "even_allreduce_over_dp": seconds[EVEN] / seconds[DP],
        "even_allreduce_over_layers": seconds[EVEN] / seconds[LAYERS],
        "layers_over_limit": seconds[LAYERS] / limit,
        "even_allreduce_over_tp": seconds[EVEN] / seconds[TP],
        "jax_over_dp": seconds[JAX] / seconds[DP],
        "jax_tp_over_tp": seconds[JAX_TP] / seconds[TP],
        "dp_over_limit": seconds[DP] / limit,
        "tp_over_limit": seconds[TP] / limit,
        "sp_over_limit": seconds[SP] / limit,
        "sp_in_place_over_ahead": seconds[SP_IN_PLACE] / seconds[SP_AHEAD],
        "sp_keep_over_limit": seconds[SP_KEEP] / limit,
        "sp_over_sp_keep": seconds[SP] / seconds[SP_KEEP],
        "tp_floor_over_limit": seconds[TP_FLOOR] / limit,
        "tp_over_tp_floor": seconds[TP] / seconds[TP_FLOOR],
        "sp_floor_over_limit": seconds[SP_FLOOR] / limit,
        "sp_over_sp_floor": seconds[SP] / seconds[SP_FLOOR],
        "even_allreduce_over_limit": seconds[EVEN] / limit,
        "floor_over_limit": seconds[FLOOR] / limit,
        "even_floor_over_floor": seconds[EVEN_FLOOR] / seconds[FLOOR],
    }
    record = {
        "case": "lm_step",
        "label": args.label,
        "title": (
            f"{args.label}: char-LM Transformer train step, d={args.d}, {args.heads} heads, "
            f"{args.layers} blocks, {args.batch}x{args.context} tokens, float32, {SIZE} ranks "
            f"({common.binding_cached})"
        ),
        "ranks": SIZE,
        "machine": common.machine(),
        "binding": common.binding_cached,
        "model": {
            "d": args.d,
            "heads": args.heads,
            "layers": args.layers,
            "context": args.context,
            "batch": args.batch,
            "vocab": vocab,
            "params": int(sum(p.size for p in jax.tree.leaves(fns[ALONE][1][0]))),
        },
        "repeats": args.repeats,
        "warmup": WARMUP,
        "speeds_gflops": [float(s) for s in speeds],
        "sequences_weighted": list(weighted),
        "sequences_even": even,
        "heads_per_rank": list(heads),
        "mlp_hidden_per_rank": list(hidden),
        "jax_tp_padded": {
            "heads": -(-args.heads // SIZE) * SIZE,
            "mlp_hidden": -(-4 * args.d // SIZE) * SIZE,
        },
        "step_gflop": flops / 1e9,
        "first_step_loss": losses,
        "entries": entries,
        "alone_seconds_per_rank": alone,
        "aggregate_limit_s": limit,
        "aggregate_limit_gemm_s": limit_gemm,
        "ratios": ratios,
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": COMM.allreduce(time.time() - started, op=MPI.MAX),
        **common.memory_fields(rss_start),
    }
    record["notes"] = _notes(record)
    common.print_table(record, baseline=DP)
    common.save(record, args.json)
    if RANK == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lm_step.md").write_text(markdown(record))
        plot(record, out / "lm_step.png")
        print(f"\nwrote {out / 'lm_step.md'} and {out / 'lm_step.png'} ({record['wall_s']:.0f} s)")
    return 0


def _notes(record: dict) -> list[str]:
    r, limit = record["ratios"], record["aggregate_limit_s"]
    padded = record["jax_tp_padded"]
    alone = ", ".join(f"{t * 1e3:.0f}" for t in record["alone_seconds_per_rank"])
    return [
        f"The even all-reduce step takes {r['even_allreduce_over_dp']:.2f}x the speed-weighted "
        f"DP step's time (target >= 1.2) and {r['even_allreduce_over_tp']:.2f}x the speed-weighted "
        f"TP step's; DP takes {r['dp_over_limit']:.2f}x the aggregate limit and TP "
        f"{r['tp_over_limit']:.2f}x (target <= 1.15); JAX NamedSharding takes "
        f"{r['jax_over_dp']:.2f}x DP's time. TP with sequence parallelism takes "
        f"{r['sp_over_limit']:.2f}x the limit. TP's own no-communication floor (each rank's "
        f"shards, the rest of the model on every rank) is {r['tp_floor_over_limit']:.2f}x the "
        f"limit, and TP takes {r['tp_over_tp_floor']:.2f}x that floor; with sequences between "
        f"the pairs, the floor is {r['sp_floor_over_limit']:.2f}x the limit and TP + SP "
        f"{r['sp_over_sp_floor']:.2f}x it. With osmm_jax's DP "
        "layers (one sum per layer) "
        f"instead of one fused sum, DP takes {r['layers_over_limit']:.2f}x the aggregate limit "
        f"and the even all-reduce step {r['even_allreduce_over_layers']:.2f}x its time. Without any "
        f"communication, the even split takes {r['even_floor_over_floor']:.2f}x the "
        "speed-weighted split's time: no even-split step can be slower than that by its split "
        "alone.",
        f"JAX's own tensor-parallel step (even shards: {padded['heads']} heads and "
        f"{padded['mlp_hidden']} MLP features with the zero padding) takes "
        f"{r['jax_tp_over_tp']:.2f}x the speed-weighted TP step's time.",
        "Sequence parallelism with its fetches in place takes "
        f"{r['sp_in_place_over_ahead']:.2f}x the time of the same step fetching ahead (the "
        "gathered rows arrive while the GEMMs on each rank's own rows run). With the column "
        "layers keeping what they gathered for the backward pass (keep_fetched), TP + SP takes "
        f"{r['sp_keep_over_limit']:.2f}x the limit; the step that gathers again takes "
        f"{r['sp_over_sp_keep']:.2f}x its time.",
        f"Aggregate limit {limit * 1e3:.0f} ms = 1 / sum(1 / T_r), T_r = each rank's own median "
        f"time for the whole step alone, all ranks at once: {alone} ms (from GEMM rates instead: "
        f"{record['aggregate_limit_gemm_s'] * 1e3:.0f} ms).",
        "Speeds (GFLOP/s): "
        + ", ".join(f"{s:.1f}" for s in record["speeds_gflops"])
        + f"; sequences per rank {record['sequences_weighted']} (even {record['sequences_even']}),"
        f" heads {record['heads_per_rank']}, MLP hidden {record['mlp_hidden_per_rank']}.",
    ]


def markdown(record: dict) -> str:
    """lm_step.md: where and when, the table of medians, the ratios against the targets."""
    m, r, limit = record["model"], record["ratios"], record["aggregate_limit_s"]
    load = record["load_average"]
    # The benchmark's own ranks keep about one core each busy and count in the load average.
    busy = max(load["start"][0], load["end"][0]) > (os.cpu_count() or 1) + record["ranks"]
    bind = record["binding"]
    bind_option = "" if bind == "unbound" or "+" in bind else f" -bind-to user:{bind}"
    lines = [
        "# Transformer train step on ranks of unequal speed",
        "",
        f"`mpiexec -n {record['ranks']}{bind_option} python -m benchmarks.lm_step` "
        f"({record['wall_s']:.0f} s), {record['utc']}, {record['machine']}; "
        f"CPUs per rank {record['binding']}; load average (1, 5, 15 min) "
        + " / ".join(f"{v:.2f}" for v in load["start"])
        + " at the start, "
        + " / ".join(f"{v:.2f}" for v in load["end"])
        + " at the end.",
        "",
    ]
    if busy:
        lines += [
            "**The load average exceeded the number of cores plus this benchmark's ranks: "
            "other work shared the machine and these timings are not representative.**",
            "",
        ]
    lines += [
        f"Model: examples/train_lm.py's GPT, d={m['d']}, {m['heads']} heads, {m['layers']} "
        f"blocks, vocabulary {m['vocab']}, {m['params']:,} parameters, float32; one adam step "
        f"on {m['batch']} sequences of {m['context']} characters "
        f"({record['step_gflop']:.1f} GFLOP of products). Medians of {record['repeats']} "
        f"interleaved rounds after warm-up; each round's time is the slowest rank's.",
        "",
        "| step | median (ms) | tokens/s | GFLOP/s | ÷ aggregate limit |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for e in record["entries"]:
        lines.append(
            f"| {e['name']} | {e['seconds'] * 1e3:.1f} | {e['tokens_per_s']:,.0f} | "
            f"{e['gflops']:.1f} | {e['seconds'] / limit:.2f} |"
        )
    lines.append(
        f"| aggregate limit (no communication, split by speed) | {limit * 1e3:.1f} | | | 1.00 |"
    )
    lines += [
        "",
        "| target (time ratio) | measured | required | met |",
        "| --- | ---: | --- | --- |",
    ]
    for text, key, sign, bound in TARGETS:
        value = r[key]
        ok = value >= bound if sign == ">=" else value <= bound
        lines.append(f"| {text} | {value:.2f} | {sign} {bound} | {'yes' if ok else '**no**'} |")
    lines += ["", *[f"- {note}" for note in record["notes"]], ""]
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """lm_step.png: median time per step (bars, with the middle half of the rounds as whiskers)
    and the aggregate limit (dashed line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    names = [e["name"] for e in record["entries"]]
    medians = np.asarray([e["seconds"] for e in record["entries"]]) * 1e3
    quartiles = np.asarray([np.percentile(e["times"], [25, 75]) for e in record["entries"]]) * 1e3
    colors = ["tab:blue" if "osmm" in n else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.barh(
        names,
        medians,
        color=colors,
        xerr=np.abs(quartiles.T - medians),
        error_kw={"elinewidth": 1, "capsize": 3},
    )
    limit = record["aggregate_limit_s"] * 1e3
    ax.axvline(limit, color="tab:red", linestyle="--", label=f"aggregate limit {limit:.0f} ms")
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms); whiskers: 25th-75th percentile of rounds")
    ax.set_title(textwrap.fill(record["title"], 80), fontsize=8)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
