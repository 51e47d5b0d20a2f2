"""What the watchdog costs a product: one_sided K-split products with the watchdog off
(``OSMM_TIMEOUT=0``), on in its default ``abort`` mode, and on in ``raise`` mode.

    mpiexec -n 2 python -m benchmarks.watchdog_overhead --size 64 --size 2048 [--json FILE]

In every setting each rank publishes where it is (a few atomic stores per blocking step) and
each epoch reads the next rank's window header (one 16-byte MPI_Get): those are part of every
product. ``abort`` adds only the watchdog thread's checks, a few times a second; ``raise``
adds a bounded barrier (MPI_Ibarrier, polled) before every synchronising fence. The three
settings are interleaved in shuffled rounds (benchmarks.common.interleaved_times), switched
with ``osmm_jax.timeout`` around each product.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import osmm_jax as om
from benchmarks import common

SETTINGS = {"off": (0.0, "abort"), "abort": (300.0, "abort"), "raise": (300.0, "raise")}


def k_split_product(size: int):
    """A jitted K-split product of size³ over every rank (A by columns, B by rows, C by rows)
    and this rank's float32 blocks."""
    plan = om.plan(
        om.Layout.cols((size, size)), om.Layout.rows((size, size)), om.Layout.rows((size, size))
    )
    rng = np.random.default_rng(0)
    a = jnp.asarray(plan.a.shard(rng.standard_normal((size, size), np.float32), common.RANK))
    b = jnp.asarray(plan.b.shard(rng.standard_normal((size, size), np.float32), common.RANK))
    return jax.jit(lambda x, y: om.matmul(x, y, plan)), (a, b)


def under(setting: str, fn):
    seconds, mode = SETTINGS[setting]

    def run(*args):
        with om.timeout(seconds, mode):
            return jax.block_until_ready(fn(*args))

    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, action="append", help="M = K = N (repeatable)")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--json", help="append the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    for size in args.size or [64, 2048]:
        fn, operands = k_split_product(size)
        fns = {name: (under(name, fn), operands) for name in SETTINGS}
        times = common.interleaved_times(fns, args.repeats, warmup=3)
        record = {
            "title": f"watchdog overhead: one_sided K-split {size}³ float32 on {common.SIZE} ranks",
            "label": f"watchdog_{size}",
            "repeats": args.repeats,
            "entries": common.summarise(times, 2.0 * size**3),
            "notes": [
                "off: OSMM_TIMEOUT=0; abort: the default watchdog; raise: "
                "OSMM_ON_TIMEOUT=raise (a bounded barrier before each synchronising fence)"
            ],
        }
        common.print_table(record, baseline="off")
        common.save(record, args.json)


if __name__ == "__main__":
    main()
