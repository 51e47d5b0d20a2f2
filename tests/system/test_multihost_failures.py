"""A rank that fails on one host ends the whole job across hosts, with a report, never a hang.

3 emulated hosts (network namespaces made by tests/multihost/netns.py), one rank each, over
TCP with the venv's MPI (MPICH or Intel MPI under hydra, Open MPI under prterun), the launcher
starting its proxies through tests/multihost/ns-launch in place of ssh (see
tests/system/test_multihost.py and tests/multihost/launch.py). Each job runs tests/failure_programs/failing_rank.py
with OSMM_TIMEOUT=5: its last rank (on host 2) fails between two small K-split products while
the others wait for it in the next one, or (the ``-fence`` cases) dies in the middle of the
products, the others inside a product's fence. Whatever the failure, the job must end with a
non-zero status and a report naming rank 2 within OSMM_TIMEOUT + 10 s of the failure, and
leave no process behind on any host; with OSMM_ON_TIMEOUT=raise too.

Across hosts the launcher does not end a job whose rank died (its proxy's news of the death
does not reach the others' proxies in time, or at all), so osmm_jax's watchdog does: after
the timeout it reports and ends the job, bounded whatever MPI does on the way (a TCP connect to
the dead rank retried forever inside an MPI call). A rank that raises tells the others through
the side channel, and they end the job at once. Where the MPI ends the job first, its own
report must name rank 2 (hydra's banner its host, prterun the process or its host's daemon);
two Open MPI behaviours that fall short are recognised and marked expected failures (below).
Needs root; skipped otherwise.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from jobs import OPEN_MPI, REPO

sys.path.insert(0, str(REPO / "tests" / "multihost"))

import netns  # noqa: E402
from launch import INTEL_MPI, launch, unavailable  # noqa: E402

PROGRAM = REPO / "tests" / "failure_programs" / "failing_rank.py"
HOSTS = 3
TIMEOUT_S = 5  # OSMM_TIMEOUT
LIMIT_S = TIMEOUT_S + 10  # from the failure to the end of the job
HARD_TIMEOUT_S = 150.0  # the whole job, start-up included (a loaded machine is slow to start)
FAILING = 2
HOWS = ["exit7", "sigkill", "segfault", "exception", "xlaerror", "sigstop", "linkdown"]
HOWS += ["exit7-fence", "sigkill-fence", "segfault-fence"]

_REASON = unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}")

_FAILURE = re.compile(r"^FAILURE (\d+\.\d+) ", re.MULTILINE)
_RAISED = re.compile(r"^RAISED (\d+\.\d+) ", re.MULTILINE)
# What raise mode does today: a rank waiting in a product's fence ends the job on a notice.
# Seen in about half the exit7-fence jobs: MPICH (libfabric TCP) segfaults inside
# MPI_Win_fence on a rank that waits in the closing fence when its peer dies; hydra then ends
# the job at once (status 255, no hang), its banner naming the crashed survivor's host.
SURVIVOR_CRASH = (
    "a surviving rank segfaulted inside MPICH's MPI_Win_fence (the closing fence of the "
    "product its peer died in); the job ended at once, but no report names the dead rank"
)
# Open MPI: its TCP BTL ends a survivor itself when the dead rank's socket closes ("An error
# occurred in Socket closed ... on a NULL communicator", MPI_ERRORS_ARE_FATAL), and prterun
# then reports that survivor's abort, not the death that caused it, whenever the BTL is first.
# ob1 aborts on any error callback from a BTL, whatever the error handlers say (Open MPI's
# own account: https://github.com/open-mpi/ompi/issues/5849). Its fault-tolerant mode, the only
# way out (prterun --with-ft ulfm, built into the wheel), is no workaround here: osc/rdma is
# untested under it (its "module:untested:failundef" warning), a survivor segfaulted in
# ompi_osc_rdma_rget, and prterun exited with status 0.
SOCKET_CLOSED_ABORT = (
    "Open MPI's TCP BTL aborted a survivor on the dead rank's closed socket before prterun "
    "reported the death: the job ended at once, but its report names the survivor"
)
_SOCKET_CLOSED = "*** An error occurred in Socket closed"
# Open MPI: prterun ends the job seconds after the partitioned host's daemon goes silent (with
# launch.py's oob_tcp_keepalive_* settings), naming that host, but exits with status 0.
LOST_DAEMON_STATUS_0 = (
    "prterun ended the job when it lost the partitioned host's daemon, and said so, but "
    "exited with status 0"
)
_LOST_DAEMON = "PRTE has lost communication with a remote daemon"
_REASON_TEXT = f"RuntimeError: rank {FAILING} gives up between products"
_BANNER = "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES"
# Intel MPI: after its host drops off the network, osmm_jax's watchdog names the rank and
# ends the others (MPI_Abort; every rank and proxy is gone within seconds), but mpiexec waits
# on for the partitioned host's proxy, whose connection TCP does not give up for many minutes.
PROXY_WAIT = (
    "Intel MPI's mpiexec waits for the partitioned host's proxy after every rank has ended "
    "(osmm_jax's report named the rank and called MPI_Abort)"
)
_WATCHDOG_ENDS = "Ending the job: MPI_Abort(MPI_COMM_WORLD"
# Intel MPI's hydra prints no banner for a rank that exits with a status; with
# -print-all-exitcodes (launch.py) it lists every rank's wait status, "[address:index] status"
# (1792 is exit(7); the ranks it killed show 9).
_EXIT_CODE = r"\[{address}:\d+\] (\d+)"


def _exit_code_names(address: str, output: str) -> bool:
    """Whether hydra's exit codes show the rank at ``address`` ending by itself."""
    codes = re.findall(_EXIT_CODE.format(address=re.escape(address)), output)
    return any(int(code) not in (0, 9) for code in codes)


@pytest.fixture(scope="module")
def hosts():
    """The emulated hosts, removed at the end (even on SIGTERM or SIGHUP)."""
    with netns.emulated_hosts(HOSTS) as made:
        yield made


def _leftovers(hosts) -> dict[str, list[str]]:
    """The processes still running on each host, after a short grace."""
    left = {}
    for _ in range(20):
        left = {}
        for name in hosts.names:
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
            if pids:
                left[name] = pids
        if not left:
            break
        time.sleep(0.25)
    return left


def _run(hosts, how: str, **settings: str) -> tuple[str, float]:
    """Run the job with rank 2 failing by ``how``; check that it ended in time, non-zero, with a
    report naming rank 2 and nothing left behind; return its output and its end time after
    the failure (s). The ``-fence`` cases run the fence mode unless told otherwise."""
    if how.endswith("-fence"):
        settings.setdefault("OSMM_SYNC", "fence")
    try:
        status, output, _ = launch(
            hosts,
            (1,) * HOSTS,
            [how],
            genv={"OSMM_TIMEOUT": str(TIMEOUT_S), **settings},
            program=PROGRAM,
            timeout=HARD_TIMEOUT_S,
        )
        ended = time.time()
    finally:
        if how == "linkdown":  # the failing rank took its host off the network
            link_up = [*hosts.exec_in(FAILING), "ip", "link", "set", "eth0", "up"]
            subprocess.run(link_up, check=True)
    tail = output[-6000:]
    failure = _FAILURE.search(output)
    assert failure, f"rank {FAILING} never got to fail (status {status}):\n{tail}"
    if status is None and INTEL_MPI and _WATCHDOG_ENDS in output:
        assert _names_failing_rank(hosts, output), f"no report names rank {FAILING}:\n{tail}"
        pytest.xfail(PROXY_WAIT)
    assert status is not None, f"still running {HARD_TIMEOUT_S:.0f} s after it started:\n{tail}"
    elapsed = ended - float(failure.group(1))
    mode = "".join(f", {name}={value}" for name, value in settings.items())
    print(f"{how}{mode} across {HOSTS} hosts: status {status}, ended {elapsed:.1f} s after")
    if status == 0 and OPEN_MPI and _LOST_DAEMON in output and hosts.names[FAILING] in output:
        pytest.xfail(LOST_DAEMON_STATUS_0)
    assert status != 0, f"status 0:\n{tail}"
    assert "products went on" not in output, tail
    assert elapsed < LIMIT_S, f"it ended {elapsed:.1f} s after the failure:\n{tail}"
    named = _names_failing_rank(hosts, output)
    assert not _leftovers(hosts), f"processes left behind: {_leftovers(hosts)}"
    if not named and how.endswith("-fence") and _survivor_crashed(hosts, output):
        pytest.xfail(SURVIVOR_CRASH)
    if not named and OPEN_MPI and _SOCKET_CLOSED in output:
        pytest.xfail(SOCKET_CLOSED_ABORT)
    assert named, f"no report names rank {FAILING}:\n{tail}"
    if how.endswith("-fence") and "osmm_jax watchdog" in output:
        where = {"fence": "in the closing MPI_Win_fence", "notify": "in a notified reduce"}
        assert where[settings["OSMM_SYNC"]] in output, f"not waiting in the product:\n{tail}"
    return output, elapsed


def _names_failing_rank(hosts, output: str) -> bool:
    """Whether the job's output names the failed rank: osmm_jax's report (as failed, silent,
    or behind the others); or, when the launcher saw the death first and killed the others at
    once, the launcher's: hydra's banner names the host (Intel MPI's its exit codes), Open
    MPI's prterun the process (job id, rank) or the lost host's daemon."""
    return bool(
        f"rank {FAILING} of the 3-rank communicator failed" in output
        or f"no answer from rank {FAILING}" in output
        or f"rank {FAILING}: did not answer" in output
        or re.search(rf"rank {FAILING} at #\d+", output)
        or (_BANNER in output and f"RUNNING AT {hosts.addresses[FAILING]}" in output)
        or re.search(rf"Process name: +\[prterun-\S+@\d+,{FAILING}\]", output)
        or f"process rank {FAILING} with PID" in output
        or (_LOST_DAEMON in output and f"on node {hosts.names[FAILING]}" in output)
        or _exit_code_names(hosts.addresses[FAILING], output)
    )


def _survivor_crashed(hosts, output: str) -> bool:
    """Whether hydra's banner says a rank other than the failed one died of SIGSEGV."""
    survivors = [a for i, a in enumerate(hosts.addresses) if i != FAILING]
    crashed = re.findall(r"RUNNING AT (\S+)\s*=\s*EXIT CODE: (?:11|139)\b", output)
    return _BANNER in output and any(address in survivors for address in crashed)


@pytest.mark.parametrize("how", HOWS)
def test_a_failed_rank_ends_the_job_across_hosts(hosts, how):
    _run(hosts, how)


@pytest.mark.parametrize("how", ["exit7-fence", "sigkill-fence"])
def test_a_rank_dying_inside_a_notified_product_ends_the_job_across_hosts(hosts, how):
    """The others wait in the notified finish for its stamp, not in a fence."""
    _run(hosts, how, OSMM_SYNC="notify")


def test_raise_mode_ends_the_job_with_the_reason_across_hosts(hosts):
    """OSMM_ON_TIMEOUT=raise: the ranks waiting when rank 2's notice arrives should raise an
    error naming it and its reason (and the job then end non-zero, as checked by _run)."""
    output, _ = _run(hosts, "exception", OSMM_ON_TIMEOUT="raise")
    notice = f"rank {FAILING} of the 3-rank communicator failed: {_REASON_TEXT}"
    assert notice in output, output[-6000:]
    raised = _RAISED.findall(output)
    assert raised, f"no rank raised the failed rank's notice:\n{output[-6000:]}"
    failed_at = float(_FAILURE.search(output).group(1))
    assert max(float(at) for at in raised) - failed_at < LIMIT_S, output[-6000:]
    assert notice in output[output.index("RAISED ") :], output[-6000:]
