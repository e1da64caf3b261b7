"""The chaos run's 2-node deployment (``--nnodes 2``): its membership in a real 3-member
etcd on loopback, a coordinator replica and a front-end on each node, so that the
leader's death and node 0's whole death can be drawn (``schedule.HOST_KINDS``).

Node 1 is never hit: its front-end carries the load and answers the status, and its
`serve` outlives every fault. Node 0 is restarted after its death (a new incarnation
with its own log directory); the invariants read every incarnation's logs.

    nodes = TwoNodes.start(serve_args, ep_size=4, heartbeat_timeout_s=2.0)
    nodes.front          # node 1's ServeProcess (status, load)
    nodes.leader_pid()   # the coordinator replica that leads
    nodes.kill_node0(); nodes.restart_node0()
    nodes.stop()
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from elasticep.membership.errors import MembershipStoreError
from elasticep_testkit.etcd_cluster import EtcdCluster, leader_of
from elasticep_testkit.harness.serve_process import (
    ServeProcess,
    cli_command,
    coordinator_pids,
    descendant_pids,
    free_port,
)

READY_TIMEOUT_S = 240.0  # model load on every rank of a shared 2-core machine
PREFIX = "chaos"
# what a coordinator process logs when it starts (membership/process.py): its pid and
# its control address, which is the leader key's value once it leads
_REPLICA_ADDR = re.compile(r"coordinator (?:replica|process) pid (\d+) (?:at|serves at) "
                           r"(\d+\.\d+\.\d+\.\d+:\d+)", re.M)


class TwoNodes:
    """See the module docstring. Use :meth:`start`.

    Attributes:
        etcd: the 3-member cluster; url: the ``--membership-store`` value.
        front: node 1's `serve` (never killed).
        node0: node 0's current `serve`.
        node_args: node 0's serve flags (for its restart).
        log_root: where every incarnation's logs go.
        node0_logs: node 0's log directories, oldest first.
    """

    def __init__(self, etcd: EtcdCluster, url: str, node_args: list[str],
                 log_root: Path) -> None:
        self.etcd, self.url, self.node_args, self.log_root = etcd, url, node_args, log_root
        self.front: ServeProcess | None = None
        self.node0: ServeProcess | None = None
        self.node0_logs: list[Path] = []
        self.killed: set[int] = set()  # pids of node 0's dead incarnations

    @staticmethod
    def start(serve_args: list[str], coordinator_timeout_s: float = 20.0) -> TwoNodes:
        """Start etcd, node 1 (which finds the leader through etcd), then node 0; wait
        until node 1's front-end routes to every rank.

        Raises:
            RuntimeError / TimeoutError: a node did not start (its log tail is in the
                message); everything started is stopped first.
        """
        etcd = EtcdCluster.start(3)
        url = f"{etcd.url}/{PREFIX}"
        args = [*serve_args, "--nnodes", "2", "--membership-store", url,
                "--coordinator-timeout", f"{coordinator_timeout_s:g}"]
        nodes = TwoNodes(etcd, url, args, Path(tempfile.mkdtemp(prefix="elasticep-chaos-")))
        try:
            log1 = nodes.log_root / "node1"
            log1.mkdir()
            port = free_port()
            with open(log1 / "serve.log", "w") as out:
                proc = subprocess.Popen(
                    cli_command("serve", *args, "--node-rank", "1", "--port", str(port),
                                "--log-dir", str(log1)),
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True)
            nodes.front = ServeProcess(proc, f"http://127.0.0.1:{port}", "", log1 / "serve.log")
            nodes.restart_node0()
            front = nodes.front
            front.wait_for(lambda s: s.all_healthy() and front.printed_ready(),
                           READY_TIMEOUT_S, "node 1's front-end ready", poll_s=0.2)
        except BaseException:
            nodes.stop()
            raise
        return nodes

    def restart_node0(self) -> ServeProcess:
        """Start node 0's `serve` (at start, or after its death: it then takes its slots
        back); waits until every rank is healthy.

        Raises:
            RuntimeError / TimeoutError: as ``ServeProcess.start``.
        """
        log_dir = self.log_root / f"node0-{len(self.node0_logs)}"
        self.node0_logs.append(log_dir)
        self.node0 = ServeProcess.start([*self.node_args, "--node-rank", "0"],
                                        ready_timeout_s=READY_TIMEOUT_S, log_dir=str(log_dir))
        return self.node0

    def kill_node0(self) -> set[int]:
        """SIGKILL every process of node 0 (its serve and all descendants: front-end,
        replica, ranks); returns their pids."""
        assert self.node0 is not None
        root = self.node0.proc.pid
        pids = {root} | descendant_pids(root)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.node0.proc.wait(10)
        self.killed |= pids
        return pids

    def leader(self) -> str | None:
        """The leading replica's control address, or None while none leads or etcd
        does not answer."""
        try:
            return leader_of(self.url)
        except MembershipStoreError:
            return None

    def leader_pid(self) -> tuple[str, int]:
        """(address, pid) of the coordinator replica that leads.

        Raises:
            LookupError: none leads, or no live replica of either node has its address.
        """
        address = self.leader()
        if address is None:
            raise LookupError("no coordinator replica leads")
        live = set()
        for p in (self.front, self.node0):
            if p is not None and p.proc.poll() is None:
                live |= coordinator_pids(p.proc.pid)
        for log in self.serve_logs():
            for m in _REPLICA_ADDR.finditer(log.read_text(errors="replace")):
                if m[2] == address and int(m[1]) in live:
                    return address, int(m[1])
        raise LookupError(f"the leader {address} is none of the live replicas {sorted(live)}")

    def serve_logs(self) -> list[Path]:
        """Every incarnation's serve log (node 0's, then node 1's)."""
        return [d / "serve.log" for d in self.node0_logs if (d / "serve.log").exists()] + [
            self.log_root / "node1" / "serve.log"]

    def log_dirs(self) -> list[Path]:
        """Every incarnation's worker log directory."""
        return [*self.node0_logs, self.log_root / "node1"]

    def stop(self) -> list[int]:
        """Stop both nodes (each is told before either is waited for: each one's status
        names the other's ranks) and etcd; returns the orphans."""
        live = [p for p in (self.node0, self.front) if p is not None and p.proc.poll() is None]
        for p in live:
            p.proc.send_signal(signal.SIGINT)
        orphans: list[int] = []
        for p in (self.node0, self.front):
            if p is not None:
                orphans += [pid for pid in p.stop() if pid not in self.killed]
        self.etcd.stop()
        return sorted(set(orphans))
