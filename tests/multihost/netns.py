"""Emulated hosts on one machine: network namespaces on a private bridge.

Each emulated host is a network namespace ``<prefix>h<i>`` with its own loopback and one
interface, ``eth0``, addressed ``10.78.0.<i+1>/24``. The ``eth0`` ends are veth pairs whose
other ends (``veth<i>``) sit on a bridge ``br0`` in a namespace of its own, ``<prefix>br``.
Nothing is added to the root namespace: every address exists only inside namespaces made
here, so nothing can clash with the machine's own network. The hosts share the machine's
CPUs, memory, file system and (unless the launcher gives each its own, see ``ns-launch``)
its hostname; what they do not share is the network stack, so MPI between them must go
over TCP like between real hosts.

Each host also gets a hosts file (``/etc/netns/<name>/hosts``, which ``ip netns exec``
mounts over ``/etc/hosts`` in that namespace) naming every host of the set by its namespace's
name, as a cluster's DNS would: programs that find their peers by host name (JAX's
distributed runtime and gloo) then reach them over ``eth0`` (when the launcher gives each
host its own hostname, see ``ns-launch``).

The prefix is ``osmm-<pid>-`` (the pid of the process that made the set), so two runs at
once do not touch each other's hosts; :func:`remove_stale` deletes the sets left behind by
processes that no longer exist (a run killed before it could clean up), and
:func:`emulated_hosts` always deletes its own set on the way out.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2's ``ip``. By hand::

    sudo .venv/bin/python tests/multihost/netns.py up 4      # the set osmm-manual-h0..h3
    sudo ip netns exec osmm-manual-h0 .venv/bin/mpiexec -hosts 10.78.0.1,10.78.0.2 \\
        -launcher ssh -launcher-exec tests/multihost/ns-launch -iface eth0 \\
        -genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp -genv FI_TCP_IFACE eth0 \\
        -n 2 .venv/bin/python prog.py
    sudo .venv/bin/python tests/multihost/netns.py down osmm-manual-

``up`` makes the set ``osmm-manual-`` (never taken for stale) and keeps it until ``down``;
``down`` without a prefix removes every set whose maker is gone, ``down --all`` every set.
Anything still running in a namespace is killed with it. On a real cluster the same mpiexec
line runs with the cluster's host addresses and plain ssh in place of ``ns-launch``, and
``FI_TCP_IFACE`` naming the hosts' interface.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")  # per-namespace files that `ip netns exec` mounts over /etc
SUBNET = "10.78.0"  # private, and used only inside namespaces made here
PREFIX_RE = re.compile(r"^osmm-(\d+|manual)-")
MANUAL = "osmm-manual-"
LAUNCHER = Path(__file__).resolve().with_name("ns-launch")


@dataclass(frozen=True)
class Hosts:
    """One set of emulated hosts: namespace ``names[i]`` has address ``addresses[i]``."""

    prefix: str
    names: tuple[str, ...]
    addresses: tuple[str, ...]
    bridge: str  # the namespace holding the bridge

    def exec_in(self, i: int) -> list[str]:
        """The command prefix that runs a command on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    if shutil.which("unshare") is None:
        return "needs util-linux's `unshare` command (a hostname per emulated host)"
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    probe = f"osmm-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def namespaces() -> list[str]:
    """Every network namespace whose name looks like one made here."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [n for n in names if PREFIX_RE.match(n)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(name: str) -> None:
    """Kill what still runs in namespace ``name``, then delete it (a namespace with processes
    left in it would outlive its name, and they would hold its addresses)."""
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in listed.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def _write_hosts_files(names: tuple[str, ...], addresses: tuple[str, ...]) -> None:
    """Every host's /etc/hosts: localhost, then every host of the set by name."""
    text = "127.0.0.1 localhost\n::1 localhost\n"
    text += "".join(f"{a} {n}\n" for n, a in zip(names, addresses))
    for name in names:
        (NETNS_ETC / name).mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / name / "hosts").write_text(text)


def remove(prefix: str) -> None:
    """Delete every namespace of the set ``prefix`` (idempotent; the veth pairs go with them)."""
    for name in namespaces():
        if name.startswith(prefix):
            _delete(name)


def remove_stale() -> list[str]:
    """Delete the sets whose maker is gone; return the namespaces deleted."""
    makers = {n: PREFIX_RE.match(n).group(1) for n in namespaces()}
    gone = [n for n, maker in makers.items() if maker.isdigit() and not _alive(int(maker))]
    for name in gone:
        _delete(name)
    return gone


def create(count: int, prefix: str | None = None) -> Hosts:
    """Make ``count`` hosts on a fresh bridge (removing stale sets and any set of this prefix
    first). On failure, what was made is removed before the error propagates."""
    if not 1 <= count <= 250:
        raise ValueError(f"count must be 1..250, got {count}")
    prefix = prefix or f"osmm-{os.getpid()}-"
    remove_stale()
    remove(prefix)
    names = tuple(f"{prefix}h{i}" for i in range(count))
    addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(count))
    bridge = f"{prefix}br"
    try:
        _ip("netns", "add", bridge)
        _ip("-n", bridge, "link", "set", "lo", "up")
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(names, addresses)):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            # Made inside the bridge's namespace, the peer moved straight into the host's:
            # at no moment does either end exist in the root namespace.
            _ip("-n", bridge, "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0",
                "netns", name)  # fmt: skip
            _ip("-n", bridge, "link", "set", f"veth{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
        _write_hosts_files(names, addresses)
    except BaseException:
        remove(prefix)
        raise
    return Hosts(prefix, names, addresses, bridge)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def emulated_hosts(count: int) -> Iterator[Hosts]:
    """:func:`create` ``count`` hosts for the duration of the block; always removed after, even
    when the run is ended by SIGTERM (as `timeout` ends it) or SIGHUP; after SIGKILL the next
    run removes them (their maker is gone)."""
    hosts = create(count)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield hosts
    finally:
        remove(hosts.prefix)
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "up":
        hosts = create(int(argv[1]), MANUAL)
        print(hosts.prefix)
        for name, address in zip(hosts.names, hosts.addresses):
            print(f"  {name}  {address}")
        return 0
    if argv == ["down", "--all"]:
        for name in namespaces():
            _delete(name)
        return 0
    if argv[:1] == ["down"] and len(argv) <= 2:
        if len(argv) == 2:
            remove(argv[1])
        print("\n".join(remove_stale()))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
