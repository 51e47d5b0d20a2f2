"""The MPI program the multi-host tests launch: osmm_jax products checked against numpy, and
the speed profile with a cache, on ranks spread over several (emulated or real) hosts.
``--repeat N`` checks every product N times, each traced and compiled afresh (stress.py).

Every rank builds the same global matrices (tests/mpi/product_cases.py: layouts of every
kind with uneven and empty blocks), runs the jitted forward product and its gradients
(``jax.grad``) with each method, and checks its own blocks against numpy. Then, with
``--cache FILE``, it runs ``osmm_jax.profile_speeds(cache=FILE)`` twice (measured, then read
back). Rank 0 prints one JSON line, ``RESULT {...}``: where each rank ran (hostname, network
namespace inode), how many products were checked, the failures of every rank, the speed
profile's sources (the keys are in the cache file). The exit status is 0 only if every rank passed.

Launched across emulated hosts by tests/system/test_multihost.py; by hand, e.g. on a cluster::

    mpiexec -hosts node1:2,node2:2 -genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp \\
        -genv FI_TCP_IFACE eth0 \\
        .venv/bin/python tests/multihost/program.py --combos core --cache /tmp/speeds.json
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "mpi"))

import jax  # noqa: E402
from mpi4py import MPI  # noqa: E402
from product_cases import (  # noqa: E402
    KINDS,
    METHODS,
    SAMPLE_KINDS,
    assert_product_and_grads_match,
    global_inputs,
    local_blocks,
    make_layouts,
    product_and_grads,
)

import osmm_jax as om  # noqa: E402

jax.config.update("jax_enable_x64", True)

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()

# Every kind in every position: the sample of product_cases (the data-parallel, K-split and 2-D
# grid products among them) and a product into a column split.
CORE = [*SAMPLE_KINDS, ("replicated", "replicated", "cols")]
COMBOS = {
    "core": CORE,
    "few": [CORE[0], CORE[1], CORE[3]],  # data-parallel, K-split, 2-D grid
    "all": [(a, b, c) for a in KINDS for b in KINDS for c in KINDS],
}
M, K, N = 13, 11, 7  # uneven over any rank count here


def check(kinds, method) -> None:
    plan = om.plan(*make_layouts(kinds, shifts=(0, 1, 2), m=M, k=K, n=N))
    inputs = global_inputs(m=M, k=K, n=N)
    results = product_and_grads(plan, method, *local_blocks(plan, inputs))
    assert_product_and_grads_match(plan, inputs, results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--combos", choices=sorted(COMBOS), default="core")
    parser.add_argument("--no-products", action="store_true", help="only the speed profile")
    parser.add_argument("--cache", help="profile_speeds twice with this cache file")
    parser.add_argument(
        "--repeat", type=int, default=1, help="check every product this many times (stress runs)"
    )
    args = parser.parse_args()

    start = time.perf_counter()
    imported = start - STARTED
    where = (
        socket.gethostname(),
        os.stat("/proc/self/ns/net").st_ino,
        os.environ.get("FI_PROVIDER"),
    )
    failures = []
    checked = 0
    for round_ in range(0 if args.no_products else args.repeat):
        for kinds in COMBOS[args.combos]:
            for method in METHODS:
                try:
                    check(kinds, method)
                    checked += 1
                except Exception as e:  # noqa: BLE001 - reported below, on rank 0, for all ranks
                    text = "".join(traceback.format_exception_only(e)).strip()
                    failures.append(f"round {round_} {'-'.join(kinds)} {method}: {text[-600:]}")
    products = time.perf_counter() - start
    sources = []
    if args.cache:
        for _ in range(2):
            profile = om.profile_speeds(
                size=64, repeats=3, cache=args.cache, progress=False, return_profile=True
            )
            sources.append(profile.source)
    jax.effects_barrier()
    everyone = COMM.gather(
        {
            "where": where,
            "checked": checked,
            "failures": failures,
            "seconds": (imported, products),
            "deferred": om.stats()["deferred_reduces"],
            "messages": om.stats()["messages"],
            "ahead": om.stats()["fetches_ahead"],
        },
        root=0,
    )
    if RANK == 0:
        result = {
            "ranks": len(everyone),
            "hostnames": [e["where"][0] for e in everyone],
            "netns": [e["where"][1] for e in everyone],
            "fi_provider": [e["where"][2] for e in everyone],
            "checked": [e["checked"] for e in everyone],
            "deferred": [e["deferred"] for e in everyone],
            "messages": [e["messages"] for e in everyone],
            "ahead": [e["ahead"] for e in everyone],
            "failures": {r: e["failures"] for r, e in enumerate(everyone) if e["failures"]},
            "sources": sources,
            "seconds": round(time.perf_counter() - start, 2),
            "import_seconds": [round(e["seconds"][0], 1) for e in everyone],
            "product_seconds": [round(e["seconds"][1], 1) for e in everyone],
        }
        print("RESULT " + json.dumps(result), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
