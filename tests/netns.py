"""Test hosts on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with its loopback up and one veth pair: the end named
``eth0`` inside the namespace, the other end (``Host.veth``) in the root namespace,
plugged into a bridge on a private /24 that :func:`make_test_net` picks among subnets no
interface or route of this machine uses. The root namespace holds ``.1`` on the bridge,
so a test's client reaches a host's API at ``Host.addr``; hosts get ``.2``, ``.3``, ...

Faults:
  * :meth:`TestNet.cut` / :meth:`TestNet.heal`: ``ip link set <veth> down|up`` on the
    root-side end, which drops the host's traffic in both directions (a partition);
  * :meth:`TestNet.block` / :meth:`TestNet.unblock`: ``ip route add|del prohibit
    <peer>/32`` inside one namespace, so that host can no longer send to ``peer`` while
    ``peer`` still reaches it (a one-way cut).

Everything made here (namespaces, bridge, veths) is removed when the context ends,
whether the test passed or failed, and the processes started with :meth:`TestNet.popen`
(and their descendants) are killed by pid first. Traffic goes only to the namespaces'
own addresses. Needs root (``ip netns``); where that is refused the fixture skips with
the reason, unless ``ELASTICEP_REQUIRE_NETNS=1`` (set by ``.ci/run``) makes it fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from elasticep.utils.procs import kill_pids, pid_alive
from elasticep_testkit.harness.serve_process import descendant_pids

REQUIRE_ENV = "ELASTICEP_REQUIRE_NETNS"
PREFIX = "eep"  # every name made here starts with it, then the pid of the test process
CANDIDATE_SUBNETS = [f"10.213.{i}.0/24" for i in range(0, 250, 7)]
IP_TIMEOUT_S = 10.0
SUBNET_LOCK = "/tmp/elasticep-test-netns.lock"


class NetnsUnavailable(RuntimeError):
    """This machine or user cannot make network namespaces (the message says why)."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (inside ``netns`` if given); return stdout.

    Raises:
        RuntimeError: it failed and ``check`` (the message has ip's stderr).
    """
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")
    return r.stdout


def _used_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this machine's addresses and routes (root namespace)."""
    nets = []
    for line in (_ip("-4", "-o", "addr") + _ip("-4", "route")).splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                if "/" in word or word[:1].isdigit():
                    nets.append(ipaddress.ip_network(word, strict=False))
    return nets


def pick_subnet() -> ipaddress.IPv4Network:
    """The first of :data:`CANDIDATE_SUBNETS` that overlaps nothing in use here.

    Raises:
        NetnsUnavailable: every candidate is taken.
    """
    used = [n for n in _used_networks() if n.prefixlen > 0]  # a default route overlaps all
    for text in CANDIDATE_SUBNETS:
        net = ipaddress.ip_network(text)
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsUnavailable(f"every candidate subnet ({CANDIDATE_SUBNETS[0]} ...) is in use")


def remove_stale() -> None:
    """Remove namespaces and links an earlier test process (now dead) left behind."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX):].split("-")[0]
        if name.startswith(PREFIX) and owner.isdigit() and not pid_alive(int(owner)):
            _ip("netns", "del", name, check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).splitlines():
        name = line.split(":")[1].strip() if ":" in line else ""
        owner = name[len(PREFIX):-len("br")]
        if (name.startswith(PREFIX) and name.endswith("br") and owner.isdigit()
                and not pid_alive(int(owner))):
            _ip("link", "del", name, check=False)  # its veths went with their namespaces


@dataclass(frozen=True)
class Host:
    """One test host: namespace ``netns``, address ``addr`` on the bridge, root-side
    veth end ``veth`` (what :meth:`TestNet.cut` takes down)."""

    index: int
    netns: str
    addr: str
    veth: str


@dataclass
class TestNet:
    """The hosts of one test network (:func:`make_test_net`); a context manager that
    removes them."""

    __test__ = False  # not a pytest test class

    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str  # the root namespace's address on the bridge
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _blocked: set[tuple[str, str]] = field(default_factory=set)

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (``ip netns exec`` execs it: same pid); it and
        its descendants are killed when the network is removed."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Partition ``host``: its link goes down (no traffic either way)."""
        _ip("link", "set", host.veth, "down")

    def heal(self, host: Host) -> None:
        """Undo :meth:`cut`."""
        _ip("link", "set", host.veth, "up")

    def block(self, host: Host, peer: Host) -> None:
        """One-way cut: ``host`` can no longer send to ``peer`` (``peer`` still reaches
        ``host``; replies from ``host`` are refused locally)."""
        _ip("route", "add", "prohibit", f"{peer.addr}/32", netns=host.netns)
        self._blocked.add((host.netns, peer.addr))

    def unblock(self, host: Host, peer: Host) -> None:
        """Undo :meth:`block`."""
        _ip("route", "del", "prohibit", f"{peer.addr}/32", netns=host.netns)
        self._blocked.discard((host.netns, peer.addr))

    def close(self) -> None:
        """Kill what :meth:`popen` started (by pid, with descendants), then delete every
        namespace, veth and the bridge made here. Safe to call twice."""
        pids: set[int] = set()
        for p in self.procs:
            if p.poll() is None:
                pids |= {p.pid, *descendant_pids(p.pid)}
        kill_pids(sorted(pids), timeout_s=5.0)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for host in self.hosts:
            _ip("link", "del", host.veth, check=False)  # takes the peer end with it
            _ip("netns", "del", host.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()

    def __enter__(self) -> TestNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_test_net(n_hosts: int = 2) -> TestNet:
    """Make ``n_hosts`` test hosts (2-3 is what a 2-core machine affords). Use it as a
    context manager (or call :meth:`TestNet.close`) so that they are removed.

    Raises:
        NetnsUnavailable: ``ip`` is missing or refused (not root, no CAP_NET_ADMIN,
            a kernel without namespaces or veth/bridge).
    """
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
    # Test processes running side by side (pytest-xdist workers) would otherwise pick
    # the same free subnet: the pick and the bridge address that takes it are one step.
    with open(SUBNET_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_test_net(n_hosts)


def _make_test_net(n_hosts: int) -> TestNet:
    try:
        remove_stale()
        subnet = pick_subnet()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        raise NetnsUnavailable(f"cannot inspect this machine's network: {exc}") from exc
    tag = f"{PREFIX}{os.getpid()}"
    addrs = list(subnet.hosts())
    net = TestNet(subnet, bridge=f"{tag}br", gateway=str(addrs[0]))
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.gateway}/{subnet.prefixlen}", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for i in range(n_hosts):
            host = Host(i, f"{tag}-h{i}", str(addrs[i + 1]), f"{tag}v{i}")
            _ip("netns", "add", host.netns)
            net.hosts.append(host)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
                "netns", host.netns)
            _ip("link", "set", host.veth, "master", net.bridge)
            _ip("link", "set", host.veth, "up")
            _ip("link", "set", "lo", "up", netns=host.netns)
            _ip("addr", "add", f"{host.addr}/{subnet.prefixlen}", "dev", "eth0",
                netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        net.close()
        raise NetnsUnavailable(f"cannot make network namespaces here: {exc}") from exc
    except BaseException:
        net.close()
        raise
    return net


def netns_or_skip(n_hosts: int = 2) -> TestNet:
    """:func:`make_test_net` for a fixture: skip with the reason when namespaces are
    refused, or fail when ``ELASTICEP_REQUIRE_NETNS=1`` (CI runs as root and must run
    these tests)."""
    try:
        return make_test_net(n_hosts)
    except NetnsUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{exc} ({REQUIRE_ENV}=1 requires network namespaces)")
        pytest.skip(f"{exc} (the partition tests need root for `ip netns`)")


@pytest.fixture(scope="module")
def netns_hosts() -> Iterator[TestNet]:
    """Two test hosts for the whole module (see the module docstring)."""
    with netns_or_skip(2) as net:
        yield net
