"""Coordinator leader failover on etcd, and the cost of a fenced commit (issue 46).

On a 3-member etcd cluster on 127.0.0.1 (``elasticep_testkit.etcd_cluster``), each run:
a process wins the leader lease (``membership/election.py``) and is SIGKILLed; a standby
campaigns at once and the time from the kill to its election is recorded. Separately,
``--commits`` fenced commits of a membership state the size of an EP16 deployment's are
timed (``EtcdMembershipStore.commit``: one etcd transaction each).

Usage: python -m bench.leader_failover [--runs 10] [--heartbeat-timeout 2] [--commits 200]

Prints one JSON line: runs, ttl_s, failover_s (median, max; the target is TTL + 1 s),
commit_ms (median, p99), etcd's version and the machine's CPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
import uuid

from elasticep.membership.durable_state import MembershipState
from elasticep.membership.election import LeaderLease, lease_ttl_s
from elasticep.membership.etcd_store import EtcdMembershipStore
from elasticep.membership.store import parse_store_url
from elasticep_testkit.etcd_cluster import EtcdCluster, spawn_leader


def failover_s(cluster: EtcdCluster, ttl_s: int) -> float:
    """Seconds from a SIGKILL of the leader to a standby's election."""
    url = f"{cluster.url}/bench-{uuid.uuid4().hex[:8]}"
    proc = spawn_leader(url, "leader", ttl_s)
    standby = LeaderLease(EtcdMembershipStore(parse_store_url(url)), "standby", ttl_s)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        standby.campaign(timeout_s=ttl_s + 30)
        return time.monotonic() - t0
    finally:
        standby.resign()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def commit_ms(cluster: EtcdCluster, n: int, slots: int = 16) -> list[float]:
    """Milliseconds of each of ``n`` fenced commits of a ``slots``-slot state."""
    store = EtcdMembershipStore(parse_store_url(f"{cluster.url}/bench-{uuid.uuid4().hex[:8]}"))
    group = {"name": "world", "ranks": list(range(slots)), "states": ["healthy"] * slots,
             "on_failure": "complete", "epoch": 0, "max_epoch": 0,
             "active": list(range(slots)), "transition": None, "pending_dead": [],
             "pending_admit": [], "pending_remove": [],
             "requests": {"admit": [], "remove": []}, "joined_from": {}}
    rev, out = 0, []
    for i in range(n):
        state = MembershipState({"world": {**group, "epoch": i, "max_epoch": i}}, slots,
                                '{"model": "bench"}', {"ep_size": slots,
                                                        "max_ep_size": slots, "up": [],
                                                        "down": []})
        t0 = time.perf_counter()
        rev = store.commit(state, rev)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0,
                    help="serve's --heartbeat-timeout; the lease TTL is its ceiling")
    ap.add_argument("--commits", type=int, default=200)
    args = ap.parse_args()
    ttl = lease_ttl_s(args.heartbeat_timeout)
    with EtcdCluster.start(3) as cluster:
        failovers = [failover_s(cluster, ttl) for _ in range(args.runs)]
        commits = sorted(commit_ms(cluster, args.commits))
    version = subprocess.run(["etcd", "--version"], capture_output=True,
                             text=True).stdout.split("\n")[0].split()[-1]
    print(json.dumps({
        "bench": "leader_failover", "runs": args.runs, "ttl_s": ttl,
        "failover_s": {"median": round(statistics.median(failovers), 3),
                       "max": round(max(failovers), 3)},
        "target_s": ttl + 1,
        "commit_ms": {"median": round(statistics.median(commits), 2),
                      "p99": round(commits[int(0.99 * (len(commits) - 1))], 2)},
        "etcd": version, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
