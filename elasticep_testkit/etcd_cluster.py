"""A real etcd cluster on 127.0.0.1 for tests and benches: N members, free ports, data in
a temp dir, every member killed by its own pid.

    with EtcdCluster.start(3) as cluster:
        cluster.url          # "etcd://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        cluster.kill(0)      # SIGKILL one member (quorum kept with 3)
        cluster.restart(0)   # the same member back, on its own data dir and ports

Members may live elsewhere than loopback: ``EtcdCluster.start(3, hosts=[...],
wraps=[...])`` binds member i on ``hosts[i]`` and runs it under the command prefix
``wraps[i]`` (``ip netns exec NS`` for a test host of ``tests/netns.py``, where every
port is free, so ports are then fixed rather than probed).

The binary is Debian's ``etcd-server`` (``/usr/bin/etcd``), which ``make install``
installs; a missing binary is an error, not a skip. Elections are tuned short
(50 ms heartbeat, 500 ms election timeout) so that a member kill costs the tests under
a second.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

ETCD_BIN = "etcd"
START_TIMEOUT_S = 30.0


NETNS_CLIENT_PORT, NETNS_PEER_PORT = 2379, 2380  # etcd's own; + the member's index


def distinct_free_ports(k: int) -> list[int]:
    """``k`` different TCP ports on 127.0.0.1, free a moment ago. All are bound at once
    before any is released: ports probed one at a time can repeat (the kernel may hand
    a just-released port out again), and two members on one client port leave the
    cluster a member short."""
    socks = [socket.socket() for _ in range(k)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class _Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    proc: subprocess.Popen | None = None
    wrap: tuple[str, ...] = ()


@dataclass
class EtcdCluster:
    """N etcd members on loopback; see the module docstring. Use :meth:`start`."""

    members: list[_Member]
    root: str
    _initial_cluster: str = field(default="")

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client URL, member order."""
        return [f"{m.host}:{m.client_port}" for m in self.members]

    @property
    def url(self) -> str:
        """The ``--membership-store`` value naming every member."""
        return "etcd://" + ",".join(self.endpoints)

    @staticmethod
    def start(n: int = 3, hosts: list[str] | None = None,
              wraps: list[tuple[str, ...]] | None = None) -> EtcdCluster:
        """Start ``n`` members and wait until the cluster answers a write.

        Args:
            hosts: member i's address (default: every member on 127.0.0.1, on probed
                free ports); with hosts, member i uses ports 2379 + 2i and 2380 + 2i.
            wraps: member i's command prefix (default: none).

        Raises:
            FileNotFoundError: no ``etcd`` binary on PATH (``make install`` installs it).
            TimeoutError: the cluster did not elect a leader within ``START_TIMEOUT_S``.
        """
        if shutil.which(ETCD_BIN) is None:
            raise FileNotFoundError("no etcd binary on PATH: `make install` installs "
                                    "Debian's etcd-server (apt-get install etcd-server)")
        root = tempfile.mkdtemp(prefix="elasticep-etcd-")
        wraps = wraps or [()] * n
        ports = [] if hosts else distinct_free_ports(2 * n)
        members = [_Member(f"m{i}", hosts[i] if hosts else "127.0.0.1",
                           NETNS_CLIENT_PORT + 2 * i if hosts else ports[2 * i],
                           NETNS_PEER_PORT + 2 * i if hosts else ports[2 * i + 1],
                           os.path.join(root, f"m{i}"), os.path.join(root, f"m{i}.log"),
                           wrap=tuple(wraps[i])) for i in range(n)]
        c = EtcdCluster(members, root)
        c._initial_cluster = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}"
                                      for m in members)
        try:
            for i in range(n):
                c._spawn(i)
            c.wait_writable(START_TIMEOUT_S)
        except BaseException:
            c.stop()
            raise
        return c

    def _spawn(self, i: int) -> None:
        m = self.members[i]
        client = f"http://{m.host}:{m.client_port}"
        peer = f"http://{m.host}:{m.peer_port}"
        cmd = [*m.wrap, ETCD_BIN, "--name", m.name, "--data-dir", m.data_dir,
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", self._initial_cluster,
               "--initial-cluster-state", "new", "--initial-cluster-token", self.root,
               "--heartbeat-interval", "50", "--election-timeout", "500"]
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)

    def wait_writable(self, timeout_s: float) -> None:
        """Block until a put through any live member succeeds.

        Raises:
            TimeoutError: none did within ``timeout_s`` seconds.
        """
        import etcd3gw

        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            for i, m in enumerate(self.members):
                if m.proc is None or m.proc.poll() is not None:
                    continue
                try:
                    etcd3gw.client(host=m.host, port=m.client_port,
                                   timeout=1.0).put("/elasticep-test/ping", str(i))
                    return
                except Exception as e:  # not up, or no leader yet
                    last = e
            time.sleep(0.1)
        raise TimeoutError(f"etcd cluster not writable after {timeout_s:.0f} s: {last}; "
                           f"logs in {self.root}")

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (by its pid) and reap it."""
        p = self.members[i].proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def restart(self, i: int) -> None:
        """Start member ``i`` again on its data dir (it rejoins the cluster)."""
        self.kill(i)
        self._spawn(i)

    def stop(self) -> None:
        """Kill every member and remove the data."""
        for i in range(len(self.members)):
            self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_CANDIDATE = """
import sys, time
from elasticep.membership.election import LeaderLease
from elasticep.membership.etcd_store import EtcdMembershipStore
from elasticep.membership.store import parse_store_url
store = EtcdMembershipStore(parse_store_url(sys.argv[1]))
LeaderLease(store, sys.argv[2], int(sys.argv[3])).campaign(timeout_s=30)
print("leader", flush=True)
time.sleep(600)
"""


def spawn_leader(url: str, name: str, ttl_s: int) -> subprocess.Popen:
    """A process that wins the leader lease of ``url`` (``etcd://.../PREFIX``) as
    ``name`` and then only keeps it alive: kill it (by its pid) to fail it over.

    Raises:
        RuntimeError: it did not say it leads (its stderr is in the message).
    """
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    proc = subprocess.Popen([sys.executable, "-c", _CANDIDATE, url, name, str(ttl_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    if proc.stdout.readline().strip() != "leader":
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"leader process did not lead: {err[-2000:]}")
    return proc


def leader_of(url: str) -> str | None:
    """The ``leader`` key of ``url`` (``etcd://.../PREFIX``): the elected coordinator's
    control address, or None while none leads."""
    from elasticep.membership.etcd_store import EtcdMembershipStore
    from elasticep.membership.store import parse_store_url

    store = EtcdMembershipStore(parse_store_url(url))
    try:
        value, _, _ = store.kv.get(store.key("leader"))
    finally:
        store.close()
    return None if value is None else value.decode()
