"""Stress the multi-host path: many jobs of tests/multihost/program.py across 4 emulated hosts
(6 ranks: 2, 1, 2, 1 per host, shared memory and TCP in one job), optionally with CPU burners
loading the machine, counting every product that differs from numpy.

Not part of ``make test`` (minutes to hours); for chasing rare races in the RMA epochs over
TCP. Needs root and iproute2's ``ip``, like the multi-host tests::

    sudo .venv/bin/python tests/multihost/stress.py --jobs 10 --repeat 3 --burners 2

Each job checks the core layout combinations (both methods, forward and both gradients, each
product traced afresh) ``--repeat`` times; the summary line counts the products checked and
lists every failure with its job and round. Exit status 1 if any product was wrong or any job
did not finish.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import time

import netns
from launch import HARD_TIMEOUT_S, SLOTS, launch, unavailable


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="rounds of products per job")
    parser.add_argument("--burners", type=int, default=0, help="busy processes loading the CPUs")
    parser.add_argument("--combos", default="core", choices=("core", "few", "all"))
    args = parser.parse_args(argv)
    if (reason := unavailable()) is not None:
        print(f"cannot launch across emulated hosts: {reason}", file=sys.stderr)
        return 2
    stop = multiprocessing.Event()
    # Daemons: ended with this script whatever happens before the cleanup below.
    burners = [
        multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
        for _ in range(args.burners)
    ]
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    hosts = None
    checked, failures, unfinished = 0, [], []
    started = time.perf_counter()
    try:
        hosts = netns.create(len(SLOTS))
        for b in burners:
            b.start()
        for job in range(args.jobs):
            program = ["--combos", args.combos, "--repeat", str(args.repeat)]
            timeout = HARD_TIMEOUT_S * args.repeat
            status, output, result = launch(hosts, SLOTS, program, timeout=timeout)
            if result is None or (status != 0 and not result["failures"]):
                unfinished.append((job, status, output[-2000:]))
                continue
            checked += sum(result["checked"])
            for rank, errors in result["failures"].items():
                failures += [f"job {job} rank {rank}: {e}" for e in errors]
    finally:
        if hosts is not None:
            netns.remove(hosts.prefix)
        stop.set()
        for b in burners:
            if b.is_alive():
                b.join()
        for s, handler in previous.items():
            signal.signal(s, handler)
    summary = {
        "jobs": args.jobs,
        "repeat": args.repeat,
        "burners": args.burners,
        "products_checked_over_ranks": checked,
        "failures": failures,
        "unfinished_jobs": [(j, s) for j, s, _ in unfinished],
        "seconds": round(time.perf_counter() - started, 1),
    }
    print("STRESS " + json.dumps(summary), flush=True)
    for job, status, tail in unfinished:
        print(f"job {job} ended with status {status}:\n{tail}", flush=True)
    return 1 if failures or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
