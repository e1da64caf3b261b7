"""Whole-host faults under standby coordinators (issue 46): node 0's host killed, and
the leader's host cut off from etcd's majority, on test hosts in network namespaces.

Three test hosts (``tests/netns.py``) and a 2-node EP4 deployment with its membership in
a real 3-member etcd, one member per host: host 0 runs node 0 (ranks 0-1, the first
leader replica, its front-end) and etcd member m0; host 1 runs node 1 (ranks 2-3, a
standby replica, its own front-end) and m1; host 2 runs only m2, so that either node's
host alone holds a minority of etcd. The client streams from the root namespace through
the front-end of the node that is not hit. In the module's order:

1. every process of host 0's namespace (serve, front-end, leader replica, ranks, etcd
   m0) is SIGKILLed under load: no stream on node 1's front-end fails, the texts are
   the fault-free ones, node 1's replica leads and ranks 2-3 serve degraded; node 0's
   host comes back (m0 and node 0's `serve` started again) and its ranks are
   readmitted;
2. the host of whichever replica leads then is cut off (its link down) under load: the
   majority side elects a leader and serves every stream with the fault-free text; the
   cut-off replica announces the failure of the other node's ranks yet none of its
   ranks applies a commit while cut off; after the heal its ranks, declared dead, exit
   and their node relaunches them into their slots (the membership failed them; no
   --restart-failed-ranks needed), and no epoch was ever applied by two ranks with
   different active sets.

The ranks' own logs are the record of what was used: each rank logs every commit it
applies (``epoch E rank R group world: commit KIND active=[...]``, with its time).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest
from _serve_fixtures import RESULTS_TIMEOUT_S, assert_complete, burst, etcd_two_node_args, prompts
from netns import TestNet, netns_or_skip

from elasticep.membership.election import lease_ttl_s
from elasticep.membership.transitions import SlotState
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster, leader_of
from elasticep_testkit.harness.serve_process import ServeProcess, cli_command

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

HB_TIMEOUT_S = 2.0
TTL_S = lease_ttl_s(HB_TIMEOUT_S)
PROMPTS = prompts(4)
MAX_TOKENS = 16
ELECTION_SLACK_S = 2.5  # see the partition test
PREFIX = "hosts"
API_PORT, COORDINATOR_PORT = 8000, 29400  # a fresh namespace: every port is free
RANKS = {0: (0, 1), 1: (2, 3)}  # node -> its ranks
# what every rank logs when it applies a commit (distributed/state.py)
RANK_COMMIT = re.compile(r"^(\S+ \S+) .*epoch (\d+) rank (\d+) group world: commit \S+ "
                         r"active=\[([\d, ]*)\]", re.M)
ANNOUNCE = re.compile(r"^(\S+ \S+) .*coordinator: group world announce epoch \d+ .*"
                      r"dead=\[([\d, ]*)\]", re.M)


def _log_time(stamp: str) -> float:
    """A logging asctime (local time, ``YYYY-MM-DD HH:MM:SS,mmm``) as ``time.time()``."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def rank_commits(root: Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """Every world commit any rank applied: (time, epoch, rank, active set), read from
    every ``rank<r>.log`` under ``root``."""
    return [(_log_time(m[1]), int(m[2]), int(m[3]), _ranks(m[4]))
            for path in sorted(root.glob("**/rank*.log"))
            for m in RANK_COMMIT.finditer(path.read_text(errors="replace"))]


def announced(serve_log: Path) -> list[tuple[float, tuple[int, ...]]]:
    """(time, dead ranks) of every world epoch a coordinator announced in ``serve_log``."""
    return [(_log_time(m[1]), _ranks(m[2]))
            for m in ANNOUNCE.finditer(serve_log.read_text(errors="replace"))]


def split_brain(commits: list[tuple[float, int, int, tuple[int, ...]]]) -> dict[int, dict]:
    """Epochs under which two ranks applied different active sets: epoch -> {active
    set: ranks that applied it}."""
    by_epoch: dict[int, dict[tuple[int, ...], set[int]]] = {}
    for _, epoch, rank, active in commits:
        by_epoch.setdefault(epoch, {}).setdefault(active, set()).add(rank)
    return {e: sets for e, sets in by_epoch.items() if len(sets) > 1}


@dataclass
class Hosts:
    """The deployment: ``nodes[k]`` is node k's current `serve` (on host k)."""

    net: TestNet
    etcd: EtcdCluster
    url: str
    common: tuple[str, ...]
    logs: Path
    nodes: dict[int, ServeProcess]
    reference: list[str]

    def majority_url(self, without: int) -> str:
        """The store URL naming only the etcd members off host ``without``."""
        return ("etcd://" + ",".join(e for i, e in enumerate(self.etcd.endpoints)
                                      if i != without) + f"/{PREFIX}")

    def leading_node(self) -> int:
        """The node whose replica leads (by the leader's host address)."""
        leader = leader_of(self.url)
        assert leader is not None, "no replica leads"
        return next(k for k in (0, 1) if leader.startswith(self.net.hosts[k].addr + ":"))

    def start_node0(self, log_dir: Path) -> ServeProcess:
        """Node 0's `serve` on host 0 (at start, or taking its slots back)."""
        h0 = self.net.hosts[0]
        self.nodes[0] = ServeProcess.start(
            [*self.common, "--node-rank", "0", "--max-total-tokens", "2048"],
            ready_timeout_s=120, log_dir=str(log_dir), host=h0.addr,
            wrap=tuple(self.net.command(h0, [])), coordinator=f"{h0.addr}:{COORDINATOR_PORT}")
        return self.nodes[0]

    def check_burst(self, node: int) -> None:
        """A burst through node ``node``'s front-end gives the fault-free texts."""
        records = burst(self.nodes[node], PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
        assert_complete(records, MAX_TOKENS)
        assert [r.text for r in records] == self.reference


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hosts")
    with netns_or_skip(3) as net:
        wraps = [tuple(net.command(h, [])) for h in net.hosts]
        with EtcdCluster.start(3, hosts=[h.addr for h in net.hosts], wraps=wraps) as etcd:
            url = f"{etcd.url}/{PREFIX}"
            h1 = net.hosts[1]
            c = Hosts(net, etcd, url, etcd_two_node_args(url, HB_TIMEOUT_S), logs, {}, [])
            (logs / "node1").mkdir()
            with open(logs / "node1" / "serve.log", "w") as out:  # finds the leader in etcd
                proc1 = net.popen(h1, cli_command(
                    "serve", *c.common, "--node-rank", "1", "--host", h1.addr, "--port",
                    str(API_PORT), "--log-dir", str(logs / "node1")),
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            c.nodes[1] = ServeProcess(proc1, f"http://{h1.addr}:{API_PORT}", "",
                                      logs / "node1" / "serve.log")
            try:
                c.start_node0(logs / "node0")
                c.nodes[1].wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3]
                                    and c.nodes[1].printed_ready(), 60, "node 1's API ready")
                first = burst(c.nodes[1], PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
                assert_complete(first, MAX_TOKENS)
                c.reference = [r.text for r in first]
                yield c
            finally:
                for h in net.hosts:  # a failed partition test may have left one cut
                    net.heal(h)
                # each node's status names the other's ranks, which its stop() waits
                # for: every serve is told to stop before any is waited for
                live = [p for p in c.nodes.values() if p.proc.poll() is None]
                for p in live:
                    p.proc.send_signal(signal.SIGINT)
                for p in live:
                    p.stop(timeout_s=15)
                # whatever still runs in our namespaces is ours (a dead incarnation's
                # stray): killed by pid before the namespaces go
                for k in range(len(net.hosts)):
                    for pid in namespace_pids(net, k) - {m.proc.pid for m in etcd.members
                                                         if m.proc is not None}:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)


def namespace_pids(net: TestNet, host: int) -> set[int]:
    """Every process in host ``host``'s namespace (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", net.hosts[host].netns], capture_output=True,
                         text=True, timeout=10, check=True).stdout
    return {int(p) for p in out.split()}


def test_node0_host_killed_under_load(hosts: Hosts):
    c, node0, node1 = hosts, hosts.nodes[0], hosts.nodes[1]
    assert c.leading_node() == 0
    # node 1's front-end reached every rank on its own link (the hello carries the
    # rank's KV capacity, which the status shows); both front-ends and both replicas
    # are announced
    assert [r.max_total_tokens is not None for r in node1.status().ranks] == [True] * 4
    body = node1.status_json()
    assert sorted(body["frontends"]) == ["node0", "node1"], body["frontends"]
    assert len(body["coordinator_replicas"]) == 2, body["coordinator_replicas"]
    metrics = node1.metrics()
    assert f'elasticep_frontend{{frontend="node1",url="{node1.url}"}} 1.0' in metrics
    assert metrics.count("elasticep_coordinator_replica{") == 2
    c.check_burst(0)

    b = burst(node1, PROMPTS, MAX_TOKENS)
    assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
    victims = namespace_pids(c.net, 0)
    assert {node0.proc.pid, c.etcd.members[0].proc.pid} <= victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    results = b.results(RESULTS_TIMEOUT_S)
    assert_complete(results, MAX_TOKENS)
    assert [r.text for r in results] == c.reference

    after_kill = node1.wait_for(lambda s: s.healthy_ranks() == [2, 3]
                                and s.rank(0).state == SlotState.FAILED, 20,
                                "node 0's ranks failed on node 1's front-end")
    assert after_kill.membership_store.leader == leader_of(c.majority_url(0))
    assert c.leading_node() == 1
    # failed at the takeover, as their etcd keys went (membership/takeover.py), not
    # after a heartbeat timeout on top of the lease TTL
    coordinator_log = (c.logs / "node1" / "serve.log").read_text(errors="replace")
    assert coordinator_log.count("dead: its process left etcd's list of ranks") == 2
    assert "not back after the leader change" not in coordinator_log
    c.check_burst(1)
    node1.wait_for(lambda s: sorted(node1.status_json()["frontends"]) == ["node1"], 10,
                   "node 0's front-end gone from the directory")
    assert time.monotonic() - killed_at < 40

    # host 0 back: its etcd member, then node 0's serve, which takes its slots back in
    # place with its own API
    node0.proc.wait(10)  # (its stop() would wait for node 1's ranks, which it saw)
    c.etcd.restart(0)
    back = c.start_node0(c.logs / "node0-back")
    assert "this node 0 takes its slots back" in back.tail()
    c.check_burst(0)
    st = node1.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3], 20,
                        "node 0's ranks readmitted on node 1's front-end")
    assert st.epoch > after_kill.epoch
    c.check_burst(1)


def test_leader_host_cut_off_from_the_etcd_majority(hosts: Hosts):
    c = hosts
    cut = c.leading_node()  # node 1 after the host kill
    other = 1 - cut
    majority = c.majority_url(cut)
    front, cut_serve = c.nodes[other], c.nodes[cut]
    before = front.status()
    assert before.healthy_ranks() == [0, 1, 2, 3]
    old = leader_of(majority)
    cut_pids = [before.rank(r).pid for r in RANKS[cut]]

    b = burst(front, PROMPTS, MAX_TOKENS)
    assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
    t_cut = time.time()
    c.net.cut(c.net.hosts[cut])
    # the majority side elects the other node's replica: the TTL, plus, when etcd's
    # raft leader was on the cut host, the majority's raft election and the lease
    # extension etcd grants every lease when a new raft leader takes over
    while (new := leader_of(majority)) in (None, old) and time.time() - t_cut < 10:
        time.sleep(0.05)
    assert new not in (None, old) and new.startswith(c.net.hosts[other].addr + ":"), new
    assert time.time() - t_cut <= TTL_S + ELECTION_SLACK_S, time.time() - t_cut
    results = b.results(RESULTS_TIMEOUT_S)
    assert_complete(results, MAX_TOKENS)
    assert [r.text for r in results] == c.reference
    during = front.wait_for(lambda s: s.healthy_ranks() == list(RANKS[other])
                            and s.rank(RANKS[cut][0]).state == SlotState.FAILED, 20,
                            "the cut-off node's ranks failed on the majority side")
    assert during.membership_store.leader == new and during.epoch > before.epoch
    # the cut-off replica saw the other node's ranks go silent and announced their
    # failure epoch (it tried), yet none of its ranks ever applies a commit after the cut
    wait_until(lambda: any(t > t_cut and dead == RANKS[other]
                           for t, dead in announced(cut_serve.log_path)), 10,
               "the cut-off replica to announce the failure of the other node's ranks")
    t_heal = time.time()
    c.net.heal(c.net.hosts[cut])
    c.check_burst(other)
    # healed, the cut-off replica finds the other leading and steps down; its ranks try
    # to resume with that leader, which declared them dead: they exit, and their node's
    # serve relaunches them (no --restart-failed-ranks: the membership failed them, they
    # did not crash), so they rejoin their slots
    wait_until(lambda: not any(pid_alive(p) for p in cut_pids), 30,
               "the cut-off node's ranks to exit after the heal")
    back = front.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3], 90,
                          "the cut-off node's ranks to rejoin after the heal")
    assert not {back.rank(r).pid for r in RANKS[cut]} & set(cut_pids)
    commits = rank_commits(c.logs)
    late = [x for x in commits if t_cut < x[0] < t_heal and x[2] in RANKS[cut]]
    assert late == [], f"the cut-off node's ranks applied commits while cut off: {late}"
    assert any(e > before.epoch and a == RANKS[other] for _, e, _, a in commits), commits
    assert split_brain(commits) == {}, split_brain(commits)
