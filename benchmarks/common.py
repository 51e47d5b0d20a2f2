"""What every benchmark shares: interleaved timing, the floor, JAX's peers, memory, records.

All functions are called on every rank (SPMD under mpiexec); results are reported by rank 0.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import osmm_jax as om

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def interleaved_times(fns: dict, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per repetition of each entry of ``{name: (fn, args)}``, interleaved in shuffled rounds.

    Each entry runs ``warmup`` times first (compilation, window allocation). A
    repetition starts after a barrier and its time is the slowest rank's, so a
    product counts as done when every rank is done. Interleaving makes drift on a
    shared machine hit every entry alike.
    """
    for fn, args in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    names = list(fns)
    order = np.random.default_rng(0)  # the same sequence on every rank
    for _ in range(repeats):
        # A fresh order each round, so no entry always runs first or right after the same
        # neighbour (what ran just before can cost the next one tens of microseconds).
        for i in order.permutation(len(names)):
            name = names[i]
            fn, args = fns[name]
            COMM.Barrier()
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(COMM.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return times


def local_floor(plan: om.Plan, dtype):
    """A jitted function running this rank's GEMMs of ``plan`` alone, on local stand-ins of
    every piece: the time the product would take if communication were free."""
    shapes = [
        (hi_r - lo_r, hi_k - lo_k, hi_c - lo_c)
        for m in plan.multiplies_on(RANK)
        for (lo_r, hi_r), (lo_k, hi_k), (lo_c, hi_c) in [(m.rows, m.inner, m.cols)]
    ]
    pieces = [(jnp.full((r, k), 0.5, dtype), jnp.full((k, c), 0.5, dtype)) for r, k, c in shapes]

    @jax.jit
    def run(pieces):
        return [jnp.dot(x, y, preferred_element_type=jnp.float32) for x, y in pieces]

    return run, (pieces,)


def reference(m: int, k: int, n: int, dtype):
    """Rank 0 doing the whole product alone (the others multiply nothing)."""
    a = jnp.ones((m, k) if RANK == 0 else (0, k), dtype)
    b = jnp.ones((k, n) if RANK == 0 else (k, 0), dtype)
    return jax.jit(jnp.dot), (a, b)


def add_run_arguments(parser, *, peers_help: str, label_default: str | None) -> None:
    """The options every benchmark takes: --repeats, --peers, --label, --json."""
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--peers", action="store_true", help=peers_help)
    parser.add_argument("--label", default=label_default, help="the case's name in the results")
    parser.add_argument("--json", help="append the results to this JSON file (rank 0)")


def start(args) -> tuple[np.ndarray, float]:
    """Common start-up, on every rank: JAX's distributed runtime if ``--peers``, then every
    rank's GEMM rate (GFLOP/s) and this process's peak RSS so far (MiB)."""
    if args.peers:
        init_jax_distributed()
    speeds = om.profile_speeds(size=1024, repeats=5, progress=False)
    return speeds, peak_rss_mib()


def init_jax_distributed() -> None:
    """JAX's own multi-process runtime over the MPI ranks, with gloo CPU collectives."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(cluster_detection_method="mpi4py")


def global_array(shape, spec, mesh, local):
    """A global jax.Array sharded by ``spec`` over ``mesh`` from this process's block."""
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [jax.device_put(local, jax.local_devices()[0])]
    )


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_fields(rss_start: float) -> dict:
    """Every rank's memory, for a record: RSS after start-up and at its peak, window MiB."""
    return {
        "rss_start_mib": COMM.allgather(rss_start),
        "rss_peak_mib": COMM.allgather(peak_rss_mib()),
        "window_mib": COMM.allgather(om.stats()["window_bytes"] / 2**20),
    }


def binding() -> str:
    """The CPUs each rank may run on, e.g. ``0,0,1`` (identical on every rank)."""
    cpus = COMM.allgather(sorted(os.sched_getaffinity(0)))
    if all(len(c) == len(cpus[0]) and len(c) > 1 for c in cpus):
        return "unbound"
    return ",".join("+".join(map(str, c)) for c in cpus)


def machine() -> str:
    cpus = os.cpu_count()
    return f"{platform.machine()} Linux, {cpus} CPU cores, Python {platform.python_version()}, JAX {jax.__version__}"


def summarise(times: dict[str, list[float]], flops: float) -> list[dict]:
    """Per entry: median seconds, GFLOP/s at that median, and every repetition."""
    return [
        {
            "name": name,
            "seconds": float(np.median(t)),
            "gflops": flops / float(np.median(t)) / 1e9,
            "times": [float(x) for x in t],
        }
        for name, t in times.items()
    ]


def print_table(record: dict, baseline: str = "one_sided") -> None:
    """Rank 0: the record's entries as a Markdown table, with ratios to ``baseline``."""
    if RANK != 0:
        return
    print(f"\n{record['title']} (median of {record['repeats']}, interleaved)\n")
    print(f"| method | time (ms) | GFLOP/s | ÷ {baseline} |")
    print("| --- | --- | --- | --- |")
    base = next(e["seconds"] for e in record["entries"] if e["name"] == baseline)
    for e in record["entries"]:
        print(
            f"| {e['name']} | {e['seconds'] * 1e3:.2f} | {e['gflops']:.1f} | "
            f"{e['seconds'] / base:.2f} |"
        )
    for line in record.get("notes", []):
        print(f"\n{line}")


def save(record: dict, path: str | None) -> None:
    """Rank 0: append ``record`` (with date and machine) to the JSON list at ``path``."""
    if RANK != 0 or not path:
        return
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "binding": binding_cached,
        **record,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = json.loads(out.read_text()) if out.exists() else []
    records.append(record)
    out.write_text(json.dumps(records, indent=1) + "\n")


binding_cached = binding()
