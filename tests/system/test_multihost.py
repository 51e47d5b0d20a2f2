"""osmm_jax across hosts: MPI over TCP between network namespaces on one machine.

tests/multihost/netns.py makes 4 emulated hosts (network namespaces ``osmm-<pid>-h0..h3``,
addresses 10.78.0.1-4 on a private bridge that lives in a namespace of its own), and this
module launches MPI jobs across them with hydra's mpiexec, run on host 0, starting its proxies
on the others through tests/multihost/ns-launch in place of ssh (``machines``: lines
``10.78.0.1:2``, ``10.78.0.2:1``, ... of address and ranks)::

    mpiexec -machinefile machines -launcher ssh -launcher-exec tests/multihost/ns-launch \\
        -iface eth0 -genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp -genv FI_TCP_IFACE eth0 ...

The mpich wheel's MPICH picks its UCX netmod by default, and UCX sees through the namespaces:
it takes them for one node and moves the data by cross-memory attach (CMA), not TCP
(``UCX_PROTO_INFO=y`` shows "intra-node ... cma/memory"), whatever ``FI_PROVIDER`` says. So
``MPIR_CVAR_CH4_NETMOD=ofi`` with ``FI_PROVIDER=tcp`` makes it use libfabric's TCP provider on
the namespaces' ``eth0`` (rank 0's ``MPIR_CVAR_DEBUG_SUMMARY`` report, checked here, names the
provider and the subnet).
Ranks on one host still talk through shared memory, except under ``MPIR_CVAR_NOLOCAL=1``.
With Intel MPI's environment (``make install MPI=impi``) the same tests run on its hydra with
``I_MPI_FABRICS=shm:ofi`` (``ofi`` alone for one host through TCP), ``FI_PROVIDER=tcp`` and
``I_MPI_DEBUG=5``, whose start-up report names the provider (tests/multihost/launch.py).

The jobs (tests/multihost/program.py) check osmm_jax products against numpy, forward and
backward, with both methods, on layouts of every kind with uneven and empty blocks:

* across the 4 hosts, 6 ranks (2, 1, 2, 1 per host), each host with its own hostname (as on a
  cluster), then ``profile_speeds`` with a cache file: measured, then read back, one key per
  rank naming its host;
* on one host, 2 ranks, with ``MPIR_CVAR_NOLOCAL=1`` (same-host traffic through TCP too), on
  fewer layouts (data-parallel, K-split, 2-D grid);
* across the 4 hosts with the machine's hostname shared by all (plain ``ip netns exec``): the
  speed cache keys then name one host for all ranks, which do share its CPUs.

Each job has a hard timeout (and osmm_jax's watchdog a shorter one); the namespaces, and
anything left running in them, are removed at the end, and before the start any set left by
a run that died. Needs root and iproute2's ``ip``; skipped otherwise. Run alone with
``sudo .venv/bin/python -m pytest tests/system/test_multihost.py -v``. On a real cluster, run
``tests/multihost/program.py`` with the same mpiexec line, the cluster's hosts and plain ssh.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from jobs import OPEN_MPI, REPO

sys.path.insert(0, str(REPO / "tests" / "multihost"))

import netns  # noqa: E402
from launch import HARD_TIMEOUT_S, HOSTS, SLOTS, TCP_SUMMARY, launch, unavailable  # noqa: E402

_REASON = unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"multi-host tests: {_REASON}")


@pytest.fixture(scope="module")
def hosts():
    """The emulated hosts, removed at the end even when the run is ended by SIGTERM (as
    `timeout` ends it: pytest then tears its fixtures down) or SIGHUP; after SIGKILL the next
    run removes them (their maker is gone)."""
    with netns.emulated_hosts(HOSTS) as made:
        yield made


def _finished(status, output, result, ranks):
    tail = output[-6000:]
    assert status is not None, f"still running after {HARD_TIMEOUT_S:.0f} s:\n{tail}"
    assert result is not None, f"no result (status {status}):\n{tail}"
    assert not result["failures"], json.dumps(result["failures"], indent=1)
    assert status == 0, f"status {status}:\n{tail}"
    assert result["ranks"] == ranks, result
    assert TCP_SUMMARY in output, f"the MPI did not report libfabric's TCP provider:\n{tail}"


def _keys(cache: Path) -> dict[int, list[str]]:
    """The speed cache's keys by rank, split into their fields."""
    entries = json.loads(cache.read_text())["entries"]
    fields = [key.split("|") for key in entries]
    return {int(re.match(r"rank (\d+)/", f[0]).group(1)): f for f in fields}


def test_products_and_speed_cache_across_four_hosts(hosts, tmp_path):
    cache = tmp_path / "speeds.json"
    status, output, result = launch(hosts, SLOTS, ["--combos", "core", "--cache", str(cache)])
    _finished(status, output, result, sum(SLOTS))
    # Every product was checked on every rank, and the ranks sat on the hosts asked for.
    assert result["checked"] == [12] * 6
    # weight gradients across hosts defer their finish by default (OSMM_DEFER unset)
    assert sum(result["deferred"]) > 0, result["deferred"]
    # and move their partials as two-sided messages (OSMM_TRANSPORT unset: auto)
    assert all(n > 0 for n in result["messages"]), result["messages"]
    # and the products that fetch small pieces fetch them ahead (OSMM_FETCH_AHEAD unset)
    assert sum(result["ahead"]) > 0, result["ahead"]
    expected = [h for h, n in zip(hosts.names, SLOTS) for _ in range(n)]
    assert result["hostnames"] == expected
    assert len(set(result["netns"])) == HOSTS
    # Measured once, then read back; one key per rank, naming its host and its host's ranks.
    assert result["sources"] == ["measured", "cache"]
    keys = _keys(cache)
    assert sorted(keys) == list(range(6))
    assert [keys[r][1] for r in range(6)] == expected
    assert [keys[r][4] for r in range(6)] == [f"shared by {n}" for n in SLOTS for _ in range(n)]


def test_products_on_one_host_through_tcp(hosts):
    """Two ranks of one host talk through the network module (MPICH: MPIR_CVAR_NOLOCAL=1;
    Intel MPI: I_MPI_FABRICS=ofi)."""
    status, output, result = launch(hosts, (2, 0, 0, 0), ["--combos", "few"], no_local=True)
    _finished(status, output, result, 2)
    assert result["checked"] == [6, 6]
    assert len(set(result["netns"])) == 1


@pytest.mark.skipif(
    OPEN_MPI,
    reason="Open MPI 5 takes hosts of one hostname for one node, and then "
    "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) never returns (a plain mpi4py job does the "
    "same); its hosts must have distinct hostnames",
)
def test_speed_cache_keys_of_hosts_sharing_a_hostname(hosts, tmp_path):
    """Namespaces that share the machine's hostname are keyed as one host: the key holds the
    hostname and no other identity, so 4 ranks on 4 namespaces read "shared by 4" (true here:
    they share its CPUs). On a cluster, hosts of equal hostnames would clash the same way."""
    cache = tmp_path / "speeds.json"
    status, output, result = launch(
        hosts, (1, 1, 1, 1), ["--no-products", "--cache", str(cache)], hostnames=False
    )
    _finished(status, output, result, 4)
    assert len(set(result["netns"])) == HOSTS and len(set(result["hostnames"])) == 1
    keys = _keys(cache)
    assert {keys[r][1] for r in range(4)} == set(result["hostnames"])
    assert {keys[r][4] for r in range(4)} == {"shared by 4"}


def test_teardown_leaves_no_namespaces(hosts):
    assert set(netns.namespaces()) >= {*hosts.names, hosts.bridge}
    netns.remove(hosts.prefix)
    assert not [n for n in netns.namespaces() if n.startswith(hosts.prefix)]
