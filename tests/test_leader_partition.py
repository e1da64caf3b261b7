"""The leader coordinator's host cut off from etcd's majority (issue 46): it stops
committing within the lease TTL, the majority side elects a leader and serves on, and
no two ranks ever use different active sets under one epoch (no split brain).

Two test hosts (``tests/netns.py``), a 2-node EP4 deployment with its membership in a
real 3-member etcd placed so that node 0's host holds the minority: member m0 on host 0,
members m1 and m2 on host 1. Node 0 (ranks 0-1) runs the leader replica; node 1 (ranks
2-3) a standby and its own front-end, which the client streams through from the root
namespace. Host 0's link goes down under load, then comes back.

The ranks' own logs are the record of what was used: each rank logs every commit it
applies (``epoch E rank R group world: commit KIND active=[...]``), so the check reads
both nodes' worker logs and compares every rank's active set per epoch.
"""

from __future__ import annotations

import re
import subprocess
import time
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

HB_TIMEOUT_S = 2.0
TTL_S = lease_ttl_s(HB_TIMEOUT_S)
PROMPTS = prompts(4)
MAX_TOKENS = 16
NODE1_PORT = 8000  # a fresh namespace: every port is free
# what every rank logs when it applies a commit (distributed/state.py)
RANK_COMMIT = re.compile(r"^(\S+ \S+) .*epoch (\d+) rank (\d+) group world: commit \S+ "
                         r"active=\[([\d, ]*)\]", re.M)

ANNOUNCE = re.compile(r"^(\S+ \S+) .*coordinator: group world announce epoch \d+ .*"
                      r"dead=\[([\d, ]*)\]", re.M)


def _log_time(stamp: str) -> float:
    """A logging asctime (local time, ``YYYY-MM-DD HH:MM:SS,mmm``) as ``time.time()``."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def rank_commits(*log_dirs: Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """Every world commit any rank applied: (time, epoch, rank, active set), read from
    the ``rank<r>.log`` files of ``log_dirs``."""
    out = []
    for d in log_dirs:
        for path in sorted(d.glob("rank*.log")):
            for m in RANK_COMMIT.finditer(path.read_text(errors="replace")):
                active = tuple(int(x) for x in m[4].replace(" ", "").split(",") if x)
                out.append((_log_time(m[1]), int(m[2]), int(m[3]), active))
    return out


def announced(serve_log: Path) -> list[tuple[float, tuple[int, ...]]]:
    """(time, dead ranks) of every world epoch a coordinator logged announcing in
    ``serve_log``."""
    return [(_log_time(m[1]), tuple(int(x) for x in m[2].replace(" ", "").split(",") if x))
            for m in ANNOUNCE.finditer(serve_log.read_text(errors="replace"))]


def split_brain(commits: list[tuple[float, int, int, tuple[int, ...]]]) -> dict[int, dict]:
    """Epochs under which two ranks applied different active sets: epoch -> {active
    set: ranks that applied it}."""
    by_epoch: dict[int, dict[tuple[int, ...], set[int]]] = {}
    for _, epoch, rank, active in commits:
        by_epoch.setdefault(epoch, {}).setdefault(active, set()).add(rank)
    return {e: sets for e, sets in by_epoch.items() if len(sets) > 1}


@pytest.fixture
def net():
    with netns_or_skip(2) as n:
        yield n


def test_leader_host_cut_off_from_the_etcd_majority(net: TestNet, tmp_path: Path):
    h0, h1 = net.hosts
    on0, on1 = tuple(net.command(h0, [])), tuple(net.command(h1, []))
    with EtcdCluster.start(3, hosts=[h0.addr, h1.addr, h1.addr],
                           wraps=[on0, on1, on1]) as cluster:
        url = f"{cluster.url}/partition"
        majority = "etcd://" + ",".join(cluster.endpoints[1:]) + "/partition"
        common = etcd_two_node_args(url, HB_TIMEOUT_S)
        logs0, logs1 = tmp_path / "node0", tmp_path / "node1"
        logs1.mkdir()
        with open(logs1 / "serve.log", "w") as log:  # finds the leader through etcd
            proc1 = net.popen(h1, cli_command(
                "serve", *common, "--node-rank", "1", "--host", h1.addr, "--port",
                str(NODE1_PORT), "--log-dir", str(logs1)),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node1 = ServeProcess(proc1, f"http://{h1.addr}:{NODE1_PORT}", "", logs1 / "serve.log")
        node0 = None
        try:
            node0 = ServeProcess.start(
                [*common, "--node-rank", "0", "--max-total-tokens", "2048"],
                ready_timeout_s=120, log_dir=str(logs0), host=h0.addr, wrap=on0,
                coordinator=f"{h0.addr}:29400")
            node1.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3]
                           and node1.printed_ready(), 60, "node 1's API ready")
            old = leader_of(majority)
            assert old == node0.coordinator, old
            first = burst(node1, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(first, MAX_TOKENS)
            reference = [r.text for r in first]
            before = node1.status()
            epoch0, node0_pids = before.epoch, [before.rank(r).pid for r in (0, 1)]

            b = burst(node1, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            t_cut = time.time()
            net.cut(h0)
            # the majority side elects node 1's replica within the TTL and a poll
            while (new := leader_of(majority)) in (None, old) and time.time() - t_cut < 10:
                time.sleep(0.05)
            assert new not in (None, old), new
            assert time.time() - t_cut <= TTL_S + 1.5, time.time() - t_cut
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference
            during = node1.wait_for(lambda s: s.healthy_ranks() == [2, 3]
                                    and s.rank(0).state == SlotState.FAILED, 20,
                                    "node 0's ranks failed on the majority side")
            assert during.membership_store.leader == new and during.epoch > epoch0
            # node 0's replica, cut off, saw ranks 2-3 go silent and decided their
            # failure epoch (so it tried to commit), yet none of its ranks applied a commit
            wait_until(lambda: any(t > t_cut and dead == (2, 3)
                                   for t, dead in announced(node0.log_path)), 10,
                       "node 0's replica to announce the failure of ranks 2-3")
            net.heal(h0)
            after = burst(node1, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(after, MAX_TOKENS)
            assert [r.text for r in after] == reference
            # healed, node 0's replica finds node 1's leading and steps down; node 0's
            # ranks try to resume with the leader, which declared them dead: they exit
            wait_until(lambda: not any(pid_alive(p) for p in node0_pids), 30,
                       "node 0's ranks to exit after the heal")
            commits = rank_commits(logs0, logs1)
            late = [c for c in commits if c[0] > t_cut and c[2] in (0, 1)]
            assert late == [], f"node 0's ranks applied commits after the cut: {late}"
            assert any(e > epoch0 and a == (2, 3) for _, e, _, a in commits), commits
            assert split_brain(commits) == {}, split_brain(commits)
        finally:
            # node 0 first: node 1's replica leads and answers its stop at once
            for p in (node0, node1):
                if p is not None:
                    p.stop(timeout_s=15)
