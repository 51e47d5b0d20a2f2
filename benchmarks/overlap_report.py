"""Run ``benchmarks.overlap_step`` (deferred finishes on and off against the all-reduce) in
shared memory and over TCP between emulated hosts; append its records to a JSON list.

Needs root for the TCP configurations (network namespaces, as ``benchmarks.sync_report``)::

    sudo .venv/bin/python -m benchmarks.overlap_report --configs shm3,tcp2,tcp3 \\
        --cases mlp,mlp:512:1536 --json benchmarks/results/overlap_step.json

Configurations: those of ``benchmarks.sync_report`` (``shm2``, ``shm3``, ``tcp2``, ``tcp3``,
``tcp4``, ...), plus ``shm3_112``: 3 ranks in shared memory bound 1:1:2 (ranks 0 and 1 share
core 0, rank 2 has core 1). The load average at each job's start is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.sync_latency import Config, job_command, load_average, netns, run_job
from benchmarks.sync_report import ALL_CONFIGS

CONFIGS = {**ALL_CONFIGS, "shm3_112": Config(3, False, "3 ranks, shared memory, bound 1:1:2")}
JOB_TIMEOUT_S = 900.0


def config_command(name: str, program: list[str], hosts, scratch: Path, settings=None):
    """``benchmarks.sync_latency.job_command`` for configuration ``name`` (``shm3_112`` bound
    1:1:2), with ``settings`` (``{variable: value}``) set in every rank."""
    config = CONFIGS[name]
    if settings:
        config = dataclasses.replace(config, env={**config.env, **settings})
    command, env = job_command(config, program, hosts, scratch)
    if name == "shm3_112":
        at = command.index("-n") + 2
        command[at:at] = ["-bind-to", "user:0,0,1"]
    return command, env


def run_config(
    name: str,
    cases: str,
    repeats: int,
    hosts,
    peers: bool = False,
    rma: bool = False,
    lm_step: bool = False,
    meetings: bool = False,
) -> list[dict]:
    """One ``benchmarks.overlap_step`` job in configuration ``name`` (``benchmarks.lm_step``
    with ``lm_step``); its records."""
    config = CONFIGS[name]
    program = [sys.executable, "-m", "benchmarks.overlap_step", "--cases", cases]
    program += ["--repeats", str(repeats), *(["--peers"] if peers else [])]
    program += ["--rma"] if rma else []
    program += ["--meetings"] if meetings else []
    uptime, load = load_average()
    with tempfile.TemporaryDirectory() as scratch:
        if lm_step:  # its tables are printed; its files stay in the scratch folder
            program = [sys.executable, "-m", "benchmarks.lm_step", "--repeats", str(repeats)]
            program += ["--out", scratch, "--json", str(Path(scratch) / "lm_step.json")]
            program += ["--meetings"] if meetings else []
        command, env = config_command(name, program, hosts, Path(scratch))
        started = time.perf_counter()
        end = run_job(command, env, JOB_TIMEOUT_S, merge_stderr=True)
        saved = Path(scratch) / "lm_step.json"
        lines = end.stdout.splitlines()
        if lm_step and saved.exists():
            lines.append(json.dumps({"title": "lm_step", **json.loads(saved.read_text())[-1]}))
    records = [
        {"config": name, "about": config.about, "load": load, "uptime": uptime, **json.loads(line)}
        for line in lines
        if line.startswith('{"title"')
    ]
    print(
        f"{name}: status {end.status}, {time.perf_counter() - started:.1f} s, "
        f"{len(records)} records, load {load}",
        flush=True,
    )
    for line in end.stdout.splitlines():
        if line.startswith("|") or line.startswith("deferred /") or '"notes"' in line:
            print(line)
    if end.status != 0 or not records:
        print(end.stdout[-4000:], flush=True)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="shm3,shm3_112,tcp2,tcp3")
    parser.add_argument("--cases", default="mlp,mlp:512:1536")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None, help="append the records to this JSON list")
    parser.add_argument("--peers", action="store_true", help="also time JAX's own DP step")
    parser.add_argument("--rma", action="store_true", help="also time OSMM_TRANSPORT=rma")
    parser.add_argument(
        "--meetings", action="store_true", help="also time the floor with a meeting per layer"
    )
    parser.add_argument(
        "--lm-step", action="store_true", help="run benchmarks.lm_step instead (--cases ignored)"
    )
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    tcp = [CONFIGS[n].ranks for n in names if CONFIGS[n].tcp]
    if tcp and (reason := netns.unavailable_reason()) is not None:
        print(f"cannot make emulated hosts: {reason}", file=sys.stderr)
        return 1
    records = []
    with contextlib.ExitStack() as stack:
        # Removed on the way out, even on SIGTERM or SIGHUP (see netns.emulated_hosts).
        hosts = stack.enter_context(netns.emulated_hosts(max(tcp))) if tcp else None
        for name in names:
            records += run_config(
                name,
                args.cases,
                args.repeats,
                hosts,
                args.peers,
                args.rma,
                args.lm_step,
                args.meetings,
            )
    if args.json:
        path = Path(args.json)
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(old + records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
