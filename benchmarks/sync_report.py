"""Run ``benchmarks.sync`` (notify against fence against the all-reduce method, per product)
over shared memory and over TCP between emulated hosts, and write ``sync.json`` / ``sync.md``.

Needs root for the TCP configurations (network namespaces, as ``benchmarks.sync_latency``)::

    sudo .venv/bin/python -m benchmarks.sync_report
    sudo .venv/bin/python -m benchmarks.sync_report --configs tcp3 --cases mlp --repeats 9

Configurations (``--configs``): those of ``benchmarks.sync_latency`` (``shm2``, ``shm3``,
``tcp2``, ``tcp3``, ...) and ``tcp4`` / ``shm4``. Every job is one ``benchmarks.sync`` run
(all its cases interleaved within a case's rounds); the load average at each job's start is
recorded, since this machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import sync_latency
from benchmarks.sync_latency import CONFIGS, Config, job_command, load_average, netns, run_job

RESULTS = sync_latency.RESULTS
JOB_TIMEOUT_S = 600.0
ALL_CONFIGS = {
    **CONFIGS,
    "shm4": Config(4, False, "4 ranks on this host (2 cores), shared memory"),
    "tcp4": Config(4, True, "4 emulated hosts, one rank each, TCP"),
}
DEFAULT_CONFIGS = "shm2,shm3,tcp2,tcp3,tcp4"
CASES = "k_split:64,k_split:256,dp_grad:64,dp_grad:256,mlp,lm_dp"


def run_config(
    name: str, cases: str, repeats: int, hosts, extra: dict | None = None
) -> tuple[dict, list[dict]]:
    config = ALL_CONFIGS[name]
    if extra:
        config = Config(config.ranks, config.tcp, config.about, {**config.env, **extra})
    program = [sys.executable, "-m", "benchmarks.sync", "--cases", cases]
    program += ["--repeats", str(repeats)]
    uptime, load = load_average()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        command, env = job_command(config, program, hosts, Path(scratch))
        env["OSMM_TIMEOUT"] = "120"
        end = run_job(command, env, JOB_TIMEOUT_S, merge_stderr=True)
    took = time.perf_counter() - started
    records = [
        {"config": name, **json.loads(line)}
        for line in end.stdout.splitlines()
        if line.startswith('{"case"')
    ]
    summary = {"config": name, "about": config.about, "load": load, "uptime": uptime}
    summary["env"] = config.env
    summary.update(status=end.status, seconds=round(took, 1), records=len(records))
    if config.tcp:
        summary["tcp_provider_confirmed"] = sync_latency.TCP_SUMMARY in end.stdout
    print(f"{name}: status {end.status}, {took:.0f} s, load {load}", flush=True)
    if end.status != 0 or not records:
        print(end.stdout[-4000:], flush=True)
    return summary, records


def _row(r: dict) -> str:
    ms = {e["name"]: e["seconds"] * 1e3 for e in r["entries"]}
    floor = ms.get("floor (local GEMMs only)")
    ranks = r.get("per_call_by_rank") or [{}]
    fence = max(x.get("fence", {}).get("closing_fence_seconds", 0.0) for x in ranks) * 1e3
    notify = max(x.get("notify", {}).get("notify_wait_seconds", 0.0) for x in ranks) * 1e3
    staged = ms.get("notify staged")
    staged_ratio = r.get("staged_vs_allreduce")
    return (
        f"| {r['case']} | {ms['notify']:.2f} | {'' if staged is None else f'{staged:.2f}'} "
        f"| {ms['fence']:.2f} | {ms['allreduce']:.2f} "
        f"| {'' if floor is None else f'{floor:.2f}'} | {r['notify_vs_allreduce']:.2f}x "
        f"| {'' if staged_ratio is None else f'{staged_ratio:.2f}x'} "
        f"| {r['fence_vs_allreduce']:.2f}x | {r['notify_vs_fence']:.2f}x | {fence:.2f} "
        f"| {notify:.2f} |"
    )


def report(summaries: list[dict], records: list[dict], path: Path) -> None:
    lines = [
        "# notify against fence against the all-reduce method",
        "",
        "Written by `sudo .venv/bin/python -m benchmarks.sync_report` (benchmarks/sync.py). Each "
        "cell: the median over interleaved rounds of the slowest rank's time, in ms, after "
        "warm-up; ratios are the all-reduce method's time over one_sided's (> 1: one_sided "
        f"faster). MPI: {sync_latency.MPI_NAME}. This machine has 2 cores: from 3 ranks on, "
        "ranks outnumber cores.",
        "",
    ]
    for summary in summaries:
        name = summary["config"]
        lines += [f"## {name}: {summary['about']}", ""]
        lines.append(f"Load average at start {summary['load']}; job status {summary['status']}.")
        if summary.get("env"):
            lines.append(f"Environment: {summary['env']}.")
        if "tcp_provider_confirmed" in summary:
            lines.append(f"TCP confirmed by the MPI's output: {summary['tcp_provider_confirmed']}.")
        lines += [
            "",
            "| case | notify | notify staged | fence | allreduce | GEMMs alone "
            "| notify vs allreduce | staged vs allreduce | fence vs allreduce | notify vs fence "
            "| fence: in closing fences | notify: in finishes |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in (r for r in records if r["config"] == name):
            lines.append(_row(r))
        lines.append("")
    lines += [
        "notify staged: the notified mode with every replicated C staged (reduce-scatter, "
        "then the notified all-gather), which notify does only where that saves more than "
        "slots.DIRECT_EXTRA_ELEMENTS elements per rank. GEMMs alone: this rank's GEMMs of "
        "the plan, no communication (product cases). In closing fences / in finishes: ms per call on the rank that spent the most there "
        "(stats() counters over 5 more calls): what the fences, or the notified finish (its "
        "waiting, flushes and sum), cost of the product's time.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS), help="folder for sync.{json,md}")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in every rank"
    )
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.env)
    names = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in names if c not in ALL_CONFIGS]:
        parser.error(f"unknown configuration: {unknown} (known: {', '.join(ALL_CONFIGS)})")
    tcp_hosts = sync_latency.hosts_needed([ALL_CONFIGS[c] for c in names])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries, records = [], []
    with contextlib.ExitStack() as stack:
        # Removed on the way out, even on SIGTERM or SIGHUP (see netns.emulated_hosts).
        hosts = stack.enter_context(netns.emulated_hosts(tcp_hosts)) if tcp_hosts else None
        for name in names:
            summary, found = run_config(name, args.cases, args.repeats, hosts, extra)
            summaries.append(summary)
            records += found
    data = {"configs": summaries, "records": records}
    (out / "sync.json").write_text(json.dumps(data, indent=1) + "\n")
    report(summaries, records, out / "sync.md")
    print(f"wrote {out / 'sync.md'}")
    return 0 if all(s["status"] == 0 and s["records"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
