"""Train a small GPT-style character-level language model on osmm_jax, and check it.

Run on 3 ranks: ``mpiexec -n 3 .venv/bin/python examples/train_lm.py --mode dp --check``
(or ``--mode tp``, ``--mode sp``, or ``--mode jax`` for JAX's own sharding); ``--mode
single`` is one process with stock layers.

The model (Flax nnx): token embedding plus learned positions, ``--layers``
pre-LayerNorm Transformer blocks (causal multi-head self-attention, then a
GELU MLP of width 4·d), a final LayerNorm and an output projection to the
vocabulary. The query, key and value projections are one dense layer whose
columns are grouped by head (each head's query, key, value), so that whole
heads split over ranks as one column-parallel layer. The text needs no
download: the source files of Python's own ``json`` package
(``os.path.dirname(json.__file__)``), read at run time; the
vocabulary is the set of characters in it. Batches are windows of
``--context`` characters at positions drawn from a seeded generator, the same
on every rank; the loss is the mean next-character cross-entropy, optimised
with optax's adam.

Modes:

* ``dp``: data parallel. The batch's sequences are split over ranks in
  proportion to speed (``osmm_jax.balance`` on ``osmm_jax.profile_speeds()``,
  or ``--speeds``); every dense layer is ``osmm_jax.flax.Linear`` with
  ``row_sizes`` counting each rank's tokens, so its kernel and bias gradients
  arrive summed over ranks; ``osmm_jax.flax.value_and_grad`` sums the rest
  (embeddings, positions, LayerNorms). Each rank's loss is its tokens'
  cross-entropy summed and divided by the global token count.
* ``tp``: tensor parallel. In every block the query, key and value
  projection is a ``ColumnParallelLinear`` layer (whole heads per rank,
  uneven: ``balance(heads, speeds)``) and the attention output projection a
  ``RowParallelLinear``; the MLP is a column- then row-parallel pair with
  uneven hidden ``sizes``. Every rank holds the whole batch; embeddings,
  LayerNorms and the output projection are stock layers computed alike on
  every rank, and every gradient is complete on every rank as it comes.
* ``sp``: tensor parallel with sequence parallelism. The same column- and
  row-parallel layers, given ``batch_sizes``: between them the activations
  are split by sequences in proportion to speed (as in ``dp``), so the
  embeddings, LayerNorms, residual sums and the output projection run on each
  rank's own sequences instead of on all of them on every rank. A
  column-parallel layer gathers every rank's sequences for its heads or hidden
  features, a row-parallel one sums the partials of each rank's sequences onto
  that rank (a reduce-scatter instead of a reduction onto every rank). Each
  rank's loss is its tokens' share of the global loss, and
  ``osmm_jax.flax.value_and_grad`` sums the gradients the layers did not
  complete (embeddings, positions, LayerNorms, the output projection, the
  row-parallel biases).
* ``jax``: JAX's own multi-process sharding, for comparison: stock layers,
  JAX's distributed runtime over the MPI ranks
  (``jax.distributed.initialize(cluster_detection_method="mpi4py")``, gloo
  collectives), one ``jax.jit`` over a one-dimensional ``data`` mesh of every
  process's device, the batch's sequences split evenly with a
  ``NamedSharding`` (JAX shards only evenly: ``--batch`` must be a multiple of
  the number of ranks, and speeds play no part), parameters and optimiser
  state replicated; JAX inserts the gradient all-reduce.
* ``single``: one process, stock ``nnx.Linear`` layers (:class:`StockLinear`, on the 2-D
  view of their input, as the osmm_jax layers): the reference.

``--check`` also trains the single-process reference on rank 0, from the same
initial parameters (the same ``nnx.Rngs`` seed: the osmm_jax layers build the
stock parameters and, in ``tp``, keep their cut), on the same batches, prints
both loss columns and exits non-zero unless every step's loss agrees to
float32 tolerance: ``|loss - reference| <= RTOL * |reference| + ATOL`` with
``RTOL = 1e-4``, ``ATOL = 1e-5``. Prints steps/s and tokens/s (steps 2..N, the
first compiles; the slowest rank's time). ``--method`` picks osmm_jax's method
(``one_sided`` or the ``allreduce`` baseline) to compare them; ``--plot PATH``
saves a loss plot on rank 0 when matplotlib is installed.

``--budgets`` (``dp``, ``tp``, ``sp``) splits within memory as well as by speed: bytes per
rank, comma-separated (``64MiB,256MiB,256MiB``; or one for all), or ``auto``
(``osmm_jax.memory_budgets()``). ``examples/lm_memory.py`` estimates a rank's bytes: in ``dp``
parameters, gradients and adam's moments (fixed) plus the activations kept per sequence, passed
to ``osmm_jax.balance(batch, speeds, memory_budget=, bytes_per_row=, fixed_bytes=)``; in
``tp``/``sp`` the replicated parameters, their state and the residual activations (fixed), the
rest of each budget shared by heads and MLP hidden features in proportion to their need, each
split by ``balance`` within its part. A rank whose speed share does not fit gets what fits, the
others the rest by speed; budgets nothing fits are an error naming the rank. Rank 0 prints the
split, predicted bytes against budgets, the ranks memory held back, and every rank's peak
resident memory at the end (``ru_maxrss``: the runtime too, which the estimate leaves out).

At the default size the model is small enough that communication, not
arithmetic, sets the pace: one process alone is faster than 3 ranks on one
machine. The example shows that the distributed modes train exactly like one
process, and lets the methods be compared with each other and with JAX's own
sharding. ``benchmarks/lm_step.py`` times the same train step at a size where
arithmetic dominates, on ranks of unequal speed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from mpi4py import MPI

import osmm_jax as om
import osmm_jax.flax as om_flax
from osmm_jax.flax import ColumnParallelLinear, Linear, RowParallelLinear

COMM = MPI.COMM_WORLD
RTOL, ATOL = 1e-4, 1e-5  # float32 agreement of each step's loss with the reference


def load_text(max_chars: int) -> str:
    """The source of Python's ``json`` package (its ``.py`` files, sorted), at most ``max_chars``."""
    folder = os.path.dirname(json.__file__)
    parts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                parts.append(f.read())
    return "".join(parts)[:max_chars]


def encode(text: str) -> tuple[np.ndarray, int]:
    """``text`` as int32 character ids (its distinct characters, sorted, numbered from 0), and
    the vocabulary size."""
    chars = sorted(set(text))
    return np.asarray([chars.index(c) for c in text], np.int32), len(chars)


class StockLinear(nnx.Linear):
    """``nnx.Linear`` (same parameters, same result) applied to the 2-D view of its input.

    XLA's CPU backend differentiates a 3-D ``(sequences, positions, features)`` product
    about 2.3x slower than the same product on ``(sequences * positions, features)`` (a
    256 -> 1024 layer on 16 x 128 tokens: 30 ms against 13 ms). The osmm_jax layers multiply
    the 2-D view, so the stock layers of the reference, of JAX's sharding and of the
    no-communication floors do too: every mode is timed with the same per-layer arithmetic.
    """

    def __call__(self, x):
        flat = super().__call__(x.reshape(-1, x.shape[-1]))
        return flat.reshape(*x.shape[:-1], flat.shape[-1])


class Layers:
    """Which dense layer each place of the model gets, per mode.

    ``column`` / ``row`` are the halves of a tensor-parallel pair (with their
    ``sizes``); ``other`` is any other dense layer (the output projection).
    ``batch_sizes`` (``tp`` only): sequences per rank between the pairs
    (sequence parallelism); ``keep_fetched``: the column layers keep the
    sequences they gathered in the forward pass for the backward pass.
    """

    def __init__(
        self,
        mode: str,
        *,
        row_sizes=None,
        head_sizes=None,
        mlp_sizes=None,
        method=None,
        batch_sizes=None,
        keep_fetched=False,
    ):
        self.mode = mode
        self.keep_fetched = keep_fetched
        self.row_sizes, self.method = row_sizes, method
        self.head_sizes, self.mlp_sizes = head_sizes, mlp_sizes
        self.batch_sizes = batch_sizes

    def dense(self, kind: str, n_in: int, n_out: int, rngs, sizes=None):
        if self.mode == "dp":
            return Linear(n_in, n_out, row_sizes=self.row_sizes, method=self.method, rngs=rngs)
        tp = {"sizes": sizes, "method": self.method, "batch_sizes": self.batch_sizes}
        tp["keep_fetched"] = self.keep_fetched
        if self.mode == "tp" and kind == "column":
            return ColumnParallelLinear(n_in, n_out, **tp, rngs=rngs)
        if self.mode == "tp" and kind == "row":
            return RowParallelLinear(n_in, n_out, **tp, rngs=rngs)
        return StockLinear(n_in, n_out, rngs=rngs)


class Block(nnx.Module):
    """Pre-LayerNorm Transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d: int, heads: int, layers: Layers, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, d // heads
        sizes = layers.head_sizes
        head_cols = None if sizes is None else [h * self.head_dim for h in sizes]
        qkv_cols = None if sizes is None else [3 * h * self.head_dim for h in sizes]
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        # Columns per head: its query, key and value (head_dim each).
        self.qkv = layers.dense("column", d, 3 * d, rngs, qkv_cols)
        self.proj = layers.dense("row", d, d, rngs, head_cols)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = layers.dense("column", d, 4 * d, rngs, layers.mlp_sizes)
        self.down = layers.dense("row", 4 * d, d, rngs, layers.mlp_sizes)

    def __call__(self, x):
        qkv = self.qkv(self.ln1(x))
        # This rank's heads: all of them, or (tensor parallel) its share of whole heads, for
        # every sequence (sequence parallel: gathered from every rank).
        b, t = qkv.shape[:2]
        local_heads = qkv.shape[-1] // (3 * self.head_dim)  # 0 on a rank memory held to none
        qkv = jnp.reshape(qkv, (b, t, local_heads, 3, self.head_dim))
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        attended = jnp.einsum("bhts,bshd->bthd", weights, v)
        attended = jnp.reshape(attended, (b, t, local_heads * self.head_dim))
        x = x + self.proj(attended)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """Token embedding + learned positions, Transformer blocks, final LayerNorm, output projection."""

    def __init__(self, vocab, context, d, heads, n_layers, layers: Layers, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, d)))
        self.blocks = nnx.List([Block(d, heads, layers, rngs) for _ in range(n_layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = layers.dense("other", d, vocab, rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(data: np.ndarray, steps: int, batch: int, context: int, seed: int):
    """``steps`` (inputs, targets) pairs of ``(batch, context)`` int32 windows; seeded."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - context - 1, size=batch)
        windows = np.stack([data[s : s + context + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def make_step(
    model, lr: float, tokens_total: int, *, dp: bool = False, mesh=None, specs=None, sum_method=None
):
    """One jitted adam step of ``model``: returns ``(step, params, opt_state)``.

    ``step(params, opt_state, x, y)`` takes ``(sequences, context)`` int32
    inputs and targets and returns ``(params, opt_state, loss)``. ``dp``: the
    loss is this rank's tokens' cross-entropy summed and divided by
    ``tokens_total`` (the global token count), and ``osmm_jax.flax.value_and_grad``
    sums the gradients that no osmm_jax layer summed; otherwise the loss is the mean over
    the tokens given. ``sum_method``: the method of that fused sum (``one_sided``, the
    default, or ``allreduce``). ``mesh``: JAX's own sharding over every process: params
    and optimiser state are global arrays over ``mesh``, replicated unless ``specs(path,
    param)`` gives another ``PartitionSpec`` (``path``: the param's key path as a string);
    ``x`` and ``y`` are global arrays (split by sequences, :func:`shard_batch`, or
    replicated), and the mean is over the global batch.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(lr)
    if mesh is None:
        placement = None
        opt_state = optimizer.init(params)
    else:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        def sharding(path, param):
            spec = P() if specs is None else specs(jax.tree_util.keystr(path), param)
            return NamedSharding(mesh, spec)

        placed = jax.tree_util.tree_map_with_path(sharding, params)
        params = jax.tree.map(
            lambda p, where: jax.make_array_from_callback(p.shape, where, lambda i: p[i]),
            params,
            placed,
        )
        # Adam's moments lie as their params do, its count is replicated; the step returns
        # everything placed so (otherwise the second step compiles again).
        like_params = jax.tree.structure(params)
        state_placed = jax.tree.map(
            lambda x: placed if jax.tree.structure(x) == like_params else NamedSharding(mesh, P()),
            jax.eval_shape(optimizer.init, params),
            is_leaf=lambda x: jax.tree.structure(x) == like_params,
        )
        opt_state = jax.jit(optimizer.init, out_shardings=state_placed)(params)
        placement = (placed, state_placed)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params, rest)(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses) / tokens_total if dp else jnp.mean(losses)

    # Data parallel: osmm_jax's value_and_grad gives the global loss's gradients, the osmm_jax
    # layers' summed by their products and every other one (embeddings, positions, LayerNorms)
    # summed in one fused transfer.
    if dp:
        value_and_grad = functools.partial(om_flax.value_and_grad, method=sum_method)
    else:
        value_and_grad = jax.value_and_grad

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if placement is not None:
            params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), placement)
        return params, opt_state, loss

    return step, params, opt_state


def _jax_peers():
    """``benchmarks.common``, which starts JAX's multi-process runtime and builds global
    arrays for the benchmarks' JAX peers (the repository root is put on ``sys.path`` when this
    file runs as a script)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import common

    return common


def start_jax_sharding():
    """JAX's multi-process runtime over the MPI ranks (gloo collectives; nothing to start on one
    process), then a one-dimensional mesh ``data`` of every process's device. Call it on every
    rank before JAX computes anything."""
    from jax.sharding import Mesh

    if COMM.Get_size() > 1:
        _jax_peers().init_jax_distributed()
    return Mesh(np.array(jax.devices()), ("data",))


def shard_batch(x: np.ndarray, mesh):
    """A global ``(sequences, ...)`` array split evenly by sequences over ``mesh``, from the
    whole batch ``x`` (the same on every rank): this process contributes its share."""
    from jax.sharding import PartitionSpec as P

    share = x.shape[0] // COMM.Get_size()
    rank = COMM.Get_rank()
    local = jnp.asarray(x[rank * share : (rank + 1) * share])
    return _jax_peers().global_array(x.shape, P("data"), mesh, local)


def train(model, data, args, *, rows=None, dp=False, comm=None, mesh=None):
    """Train ``model`` for ``args.steps`` steps; returns (losses per step, seconds of steps 2..N).

    ``rows``: the slice of each batch's sequences this rank trains on (all by
    default). ``dp``: each rank's loss is its share of the global mean, the
    reported loss the sum over ranks, and ``osmm_jax.flax.value_and_grad``
    sums the gradients that no osmm_jax layer summed. ``mesh``: JAX's own sharding (see
    :func:`make_step`); the batch is split evenly over it.
    """
    step, params, opt_state = make_step(model, args.lr, args.batch * args.context, dp=dp, mesh=mesh)
    losses = []
    start = None
    for i, (x, y) in enumerate(batches(data, args.steps, args.batch, args.context, args.seed)):
        if rows is not None:
            x, y = x[rows], y[rows]
        if mesh is not None:
            x, y = shard_batch(x, mesh), shard_batch(y, mesh)
        else:
            x, y = jnp.asarray(x), jnp.asarray(y)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(params)
            if comm is not None:
                comm.Barrier()
            start = time.perf_counter()
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    if comm is not None:
        seconds = comm.allreduce(seconds, op=MPI.MAX)
    # This process's copy of each loss (under JAX's sharding a loss is a global, replicated array).
    losses = np.asarray([jax.device_get(loss.addressable_data(0)) for loss in losses], np.float64)
    if dp and comm is not None:
        losses = comm.allreduce(losses, op=MPI.SUM)
    return losses, seconds


def _lm_memory():
    """``examples/lm_memory.py`` (its folder is put on ``sys.path`` when this file is loaded by
    path rather than run as a script)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import lm_memory

    return lm_memory


def _budgets_arg(text: str):
    try:
        return _lm_memory().parse_budgets(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("dp", "tp", "sp", "jax", "single"), default="dp")
    parser.add_argument(
        "--method",
        choices=("one_sided", "allreduce"),
        default="one_sided",
        help="osmm_jax's method in dp and tp (default one_sided)",
    )
    parser.add_argument("--check", action="store_true", help="compare with one process (rank 0)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--batch", type=int, default=24, help="sequences per step (default 24)")
    parser.add_argument("--context", type=int, default=64, help="characters per sequence")
    parser.add_argument("--d", type=int, default=96, help="model width (default 96)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--layers", type=int, default=2, help="Transformer blocks (default 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="adam learning rate")
    parser.add_argument("--chars", type=int, default=200_000, help="at most this much text")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches and weights")
    parser.add_argument(
        "--speeds",
        type=lambda s: [float(v) for v in s.split(",")],
        default=None,
        help="comma-separated speed per rank, e.g. 1,1,2 (default: measured)",
    )
    parser.add_argument(
        "--budgets",
        type=_budgets_arg,
        default=None,
        help="memory per rank in bytes, comma-separated (64MiB,256MiB,256MiB; one number for "
        "every rank), or auto (osmm_jax.memory_budgets()): split by speed within them "
        "(dp, tp, sp; default: no budgets)",
    )
    parser.add_argument("--plot", default=None, help="save a loss plot here (rank 0)")
    args = parser.parse_args(argv)
    size = COMM.Get_size()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.d % args.heads:
        parser.error("--d must be a multiple of --heads")
    if args.mode in ("dp", "sp") and args.batch < size:
        parser.error(f"--batch must be at least the number of ranks ({size}) in {args.mode}")
    if args.mode == "jax" and args.batch % size:
        parser.error(f"--batch must be a multiple of the number of ranks ({size}) in jax")
    if args.mode in ("tp", "sp") and args.heads < size:
        parser.error(f"--heads must be at least the number of ranks ({size}) in {args.mode}")
    if args.mode == "single" and size != 1:
        parser.error("--mode single runs on one process")
    if args.speeds is not None and len(args.speeds) != size:
        parser.error(f"--speeds has {len(args.speeds)} entries but there are {size} ranks")
    if args.budgets is not None and args.mode not in ("dp", "tp", "sp"):
        parser.error("--budgets applies to --mode dp, tp and sp")
    if isinstance(args.budgets, tuple) and len(args.budgets) not in (1, size):
        parser.error(f"--budgets has {len(args.budgets)} entries but there are {size} ranks")
    return args


def _plot(path, losses, reference, title, label):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot saved")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, label=label)
    if reference is not None:
        ax.plot(np.arange(1, len(reference) + 1), reference, "--", label="single process")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"loss plot: {path}")


def _shares(args, vocab, speeds):
    """``(sequences, heads, hidden features, split)`` per rank (None where ``args.mode`` splits
    no such thing) by speed; with ``--budgets`` within them too, and ``split`` is the
    ``lm_memory.Split`` that says so (else None). ValueError, the same on every rank, when no
    split fits the budgets."""
    seqs = heads = hidden = split = None
    if args.mode == "sp" or (args.mode == "dp" and args.budgets is None):
        seqs = om.balance(args.batch, speeds, min_rows=1).sizes
    if args.budgets is not None:
        lm = _lm_memory()
        budgets = om.memory_budgets(COMM) if args.budgets == "auto" else args.budgets
        model = lm.Model(vocab, args.context, args.d, args.heads, args.layers)
        split = lm.split(args.mode, model, args.batch, speeds, budgets, COMM.Get_size(), seqs)
        seqs = split.parts["sequences"].sizes if args.mode == "dp" else seqs
        heads = split.parts["heads"].sizes if args.mode != "dp" else None
        hidden = split.parts["hidden features"].sizes if args.mode != "dp" else None
    elif args.mode != "dp":
        heads = om.balance(args.heads, speeds, min_rows=1).sizes
        hidden = om.balance(4 * args.d, speeds, min_rows=1).sizes
    return seqs, heads, hidden, split


def main(argv=None) -> int:
    """Train in the chosen mode, optionally check against one process; 0 when it agrees."""
    args = _parse(argv)
    rank, size = COMM.Get_rank(), COMM.Get_size()

    def say(*lines):
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    text = load_text(args.chars)
    data, vocab = encode(text)
    # What moves the gradients: osmm_jax's method in dp and tp; JAX's sharding; none.
    method = {"jax": "NamedSharding", "single": "stock"}.get(args.mode, args.method)
    say(
        f"text: {len(text)} characters of {os.path.dirname(json.__file__)}/*.py, vocabulary {vocab}",
        f"model: d={args.d}, {args.heads} heads, {args.layers} blocks, context {args.context}; "
        f"batch {args.batch} sequences, {args.steps} steps, mode {args.mode}, {size} rank(s), "
        f"method {method}",
    )

    mesh = start_jax_sharding() if args.mode == "jax" else None
    if args.mode in ("single", "jax"):
        layers, rows = Layers("single"), None
        if args.mode == "jax":
            say(f"sequences per rank: {[args.batch // size] * size} (JAX NamedSharding, even)")
    else:
        speeds = (
            np.asarray(args.speeds)
            if args.speeds is not None
            else om.profile_speeds(size=256, repeats=3, progress=False)
        )
        say("speeds: " + ", ".join(f"{s:.1f}" for s in speeds))
        try:
            seqs, heads, hidden, split = _shares(args, vocab, speeds)
        except ValueError as exc:  # budgets nothing fits within: the same on every rank
            if rank == 0:
                print(f"train_lm.py: error: {exc}", file=sys.stderr, flush=True)
            return 2
        # This rank's sequences (dp, sp).
        rows = None if seqs is None else slice(sum(seqs[:rank]), sum(seqs[: rank + 1]))
        if args.mode == "dp":
            layers = Layers("dp", row_sizes=[s * args.context for s in seqs], method=args.method)
            say(f"sequences per rank: {list(seqs)}")
        else:
            layers = Layers(
                "tp", head_sizes=heads, mlp_sizes=hidden, method=args.method, batch_sizes=seqs
            )
            say(f"heads per rank: {list(heads)}, MLP hidden features per rank: {list(hidden)}")
            if seqs is not None:
                say(f"sequences per rank between the layer pairs: {list(seqs)}")
        if split is not None:
            say(split.estimate, *split.lines())

    def build(kind: Layers):
        return GPT(vocab, args.context, args.d, args.heads, args.layers, kind, nnx.Rngs(args.seed))

    jax.devices()  # the runtime started: the peak so far is what the model does not add
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build(layers)
    losses, seconds = train(
        model,
        data,
        args,
        rows=rows,
        dp=args.mode in ("dp", "sp"),
        comm=None if size == 1 else COMM,
        mesh=mesh,
    )
    rate = (args.steps - 1) / seconds
    tokens = rate * args.batch * args.context

    reference = None
    ok = True
    if args.check and args.mode != "single":
        if rank == 0:
            reference, _ = train(build(Layers("single")), data, args)
            ok = bool(np.all(np.abs(losses - reference) <= RTOL * np.abs(reference) + ATOL))
        ok = COMM.bcast(ok, root=0)
    if args.check and rank == 0:
        if reference is None:
            reference = losses
        say(f"{'step':>5} {args.mode + ' loss':>12} {'single loss':>12} {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(losses, reference)):
            say(f"{i + 1:5d} {a:12.6f} {b:12.6f} {abs(a - b):9.2e}")
        err = float(np.max(np.abs(losses - reference)))
        say(
            f"max |loss - single| {err:.2e} (tolerance {RTOL:g}·|loss| + {ATOL:g}): "
            + ("OK" if ok else "MISMATCH")
        )
    say(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}   {rate:.2f} steps/s   {tokens:,.0f} tokens/s "
        f"({args.mode}, {method}, {size} rank(s))"
    )
    if args.budgets is not None:  # every rank's peak resident memory, KiB on Linux
        peaks = COMM.gather((rss_before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
        say(_lm_memory().peaks_line(peaks, args.check) if rank == 0 else "")
    if args.plot and rank == 0:
        _plot(
            args.plot,
            losses,
            reference if args.check and args.mode != "single" else None,
            f"char LM, {args.mode} on {size} rank(s)",
            f"{args.mode} ({method})",
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
