"""Train a small MLP data-parallel over uneven, speed-weighted batch shards, and check it.

Run on 3 ranks: ``mpiexec -n 3 .venv/bin/python examples/train_mlp.py``.

The model is an MLP 32 -> 64 -> 64 -> 8 (tanh) built from
:class:`osmm_jax.flax.Dense`, fitted to synthetic regression data made in the
script from a fixed seed. The batch is split by rows in proportion to each
rank's speed (``osmm_jax.profile_speeds`` and ``osmm_jax.balance``, or
``--speeds``); the parameters are replicated. Each rank's loss is the sum of
its squared errors divided by the GLOBAL batch size, so the sum over ranks is
the mean over the whole batch; the layers return the gradient of that sum on
every rank, and one jitted step (``jax.value_and_grad`` plus an optax update)
is all each rank runs.

Every rank also trains the same model built from stock ``flax.linen.Dense`` on
the whole batch in one process, from the same initial parameters, and the
losses and final parameters must agree to float32 tolerance (as must the
ranks' replicas with each other). Prints steps/s for each method
(``one_sided`` and the ``allreduce`` baseline). Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import osmm_jax as om
from osmm_jax.flax import Dense

COMM = MPI.COMM_WORLD
FEATURES = (64, 64, 8)  # hidden, hidden, output; the input has 32 features
IN_FEATURES = 32
RTOL, ATOL = 1e-4, 1e-5  # float32 agreement with single-process training


class MLP(nn.Module):
    """The MLP; distributed when ``row_sizes`` is given (rows of the batch per rank), else stock."""

    row_sizes: tuple[int, ...] | None = None
    method: str | None = None

    @nn.compact
    def __call__(self, x):
        for i, features in enumerate(FEATURES):
            if self.row_sizes is None:
                x = nn.Dense(features)(x)
            else:
                x = Dense(features, row_sizes=self.row_sizes, method=self.method)(x)
            if i < len(FEATURES) - 1:
                x = jnp.tanh(x)
        return x


def make_data(batch: int, seed: int):
    """Inputs ``(batch, 32)`` and targets ``(batch, 8)`` from a fixed random teacher; float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, IN_FEATURES))
    w1 = rng.standard_normal((IN_FEATURES, 16)) / np.sqrt(IN_FEATURES)
    w2 = rng.standard_normal((16, FEATURES[-1])) / 4.0
    y = np.tanh(x @ w1) @ w2 + 0.01 * rng.standard_normal((batch, FEATURES[-1]))
    return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def make_step(model: MLP, optimizer, global_batch: int):
    """One jitted step: this rank's loss (its squared errors / ``global_batch``) and the update."""

    def loss_fn(params, x, y):
        return jnp.sum((model.apply(params, x) - y) ** 2) / global_batch

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(model: MLP, params, optimizer, x, y, *, steps: int, global_batch: int, comm=None):
    """Run ``steps`` steps from ``params``.

    Returns ``(params, losses, seconds)``: the final parameters, this rank's loss
    at each step (numpy, ``(steps,)``), and the wall time of steps 2..N (the
    first one compiles), the slowest rank's when ``comm`` is given.
    """
    step = make_step(model, optimizer, global_batch)
    opt_state = optimizer.init(params)
    losses = []
    params, opt_state, loss = step(params, opt_state, x, y)
    losses.append(loss)
    jax.block_until_ready(params)
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps - 1):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(loss)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    if comm is not None:
        seconds = comm.allreduce(seconds, op=MPI.MAX)
    return params, np.asarray(jnp.stack(losses)), seconds


def _flat(params) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(p)) for p in jax.tree.leaves(params)])


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    parser.add_argument("--batch", type=int, default=384, help="global batch rows (default 384)")
    parser.add_argument(
        "--method",
        choices=("one_sided", "allreduce", "both"),
        default="both",
        help="osmm_jax method(s) to train with (default both)",
    )
    parser.add_argument(
        "--speeds",
        type=lambda s: [float(v) for v in s.split(",")],
        default=None,
        help="comma-separated speed per rank, e.g. 1,1,2 (default: measured)",
    )
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and initial weights")
    args = parser.parse_args(argv)
    size = COMM.Get_size()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.batch < size:
        parser.error(f"--batch must be at least the number of ranks ({size})")
    if args.speeds is not None and len(args.speeds) != size:
        parser.error(f"--speeds has {len(args.speeds)} entries but there are {size} ranks")
    return args


def main(argv=None) -> int:
    """Train, compare with single-process training, print steps/s; 0 if everything agrees."""
    args = _parse(argv)
    rank, size = COMM.Get_rank(), COMM.Get_size()

    def say(*lines):
        if rank == 0:
            print(*lines, sep="\n", flush=True)

    speeds = (
        np.asarray(args.speeds)
        if args.speeds is not None
        else om.profile_speeds(size=256, repeats=3, progress=False)
    )
    split = om.balance(args.batch, speeds, min_rows=1)
    sizes = split.sizes
    start = sum(sizes[:rank])
    x, y = make_data(args.batch, args.seed)
    x_local, y_local = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
    optimizer = optax.sgd(args.lr, momentum=0.9)

    say(
        f"MLP {IN_FEATURES}-{'-'.join(map(str, FEATURES))}, batch {args.batch}, "
        f"{args.steps} steps, {size} ranks",
        "speeds: " + ", ".join(f"{s:.1f}" for s in speeds),
        f"rows per rank: {list(sizes)} (predicted imbalance {split.imbalance:.1%})",
    )

    # The reference: stock layers, whole batch, one process (every rank runs it alike).
    stock = MLP()
    params0 = stock.init(jax.random.key(args.seed), x[:1])
    ref_params, ref_losses, ref_seconds = train(
        stock, params0, optimizer, x, y, steps=args.steps, global_batch=args.batch
    )
    ref_flat = _flat(ref_params)
    say(f"single process: loss {ref_losses[0]:.5f} -> {ref_losses[-1]:.5f}")

    methods = ("one_sided", "allreduce") if args.method == "both" else (args.method,)
    ok = True
    for method in methods:
        model = MLP(row_sizes=sizes, method=method)
        params, local_losses, seconds = train(
            model,
            params0,
            optimizer,
            x_local,
            y_local,
            steps=args.steps,
            global_batch=args.batch,
            comm=COMM,
        )
        losses = COMM.allreduce(local_losses, op=MPI.SUM)  # the global mean loss per step
        flat = _flat(params)
        param_err = COMM.allreduce(float(np.max(np.abs(flat - ref_flat), initial=0.0)), op=MPI.MAX)
        replicas = COMM.allgather(flat)
        replica_err = max(float(np.max(np.abs(r - flat), initial=0.0)) for r in replicas)
        good = (
            np.allclose(losses, ref_losses, rtol=RTOL, atol=ATOL)
            and np.allclose(flat, ref_flat, rtol=RTOL, atol=ATOL)
            and replica_err <= ATOL
        )
        good = bool(COMM.allreduce(good, op=MPI.LAND))
        ok &= good
        rate = f"{(args.steps - 1) / seconds:8.1f} steps/s" if args.steps > 1 else "(one step)"
        say(
            f"{method:>9}: {rate}   loss {losses[0]:.5f} -> {losses[-1]:.5f}   "
            f"max |param - single process| {param_err:.1e}   "
            f"max |param - other ranks| {replica_err:.1e}   {'OK' if good else 'MISMATCH'}"
        )
    if args.steps > 1:
        say(
            f"single process (whole batch, stock layers): {(args.steps - 1) / ref_seconds:.1f} steps/s"
        )
    say("training matches single-process training" if ok else "TRAINING MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
