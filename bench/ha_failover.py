"""What a leader coordinator's death costs a serving deployment with standby
coordinators (issue 46): two `elasticep serve` nodes on 127.0.0.1 with their membership
in a 3-member etcd (``elasticep_testkit.etcd_cluster``), under greedy streaming load.

Each run SIGKILLs the coordinator replica that leads (its pid found among the serve
processes' descendants) while ``--concurrency`` streams run, and records:
- failover_s: from the kill until etcd's ``leader`` key names another replica (the
  target is the lease TTL + 1 s);
- resumed_s: from the kill until the front-end's status shows every rank healthy under
  the new leader (the ranks found it through etcd and said hello again);
- serving_gap_s: the longest wait of any stream for its next token among the waits that
  overlap [kill, resumed + 1 s] (a stream's wait for its first token counts too): the
  ranks stop committing steps once their lease goes stale, until they have resumed;
- failed_requests and outputs_identical (greedy texts against a fault-free pass).
The dead replica's node starts a fresh standby; the next run waits for it, so the
leadership alternates between the nodes.

``--kill node0`` kills every process of node 0 instead (its serve, front-end,
coordinator replica and ranks: its whole process tree), with the streams going through
node 1's front-end (every node serves the API under etcd). resumed_s is then the time
until node 1's front-end shows node 0's ranks failed and its own healthy (the survivors
serve degraded), and the other figures are as above, on node 1's front-end. One run:
node 0 does not come back.

Usage: python -m bench.ha_failover [--kill leader|node0] [--runs 3] [--ep-size 4]
       [--concurrency 4] [--max-tokens 48] [--heartbeat-timeout 2] [--log-dir DIR]

Prints one JSON line: kill, runs, ttl_s, failover_s / resumed_s / serving_gap_s (each the
median and max over runs), p50_gap_s (healthy inter-token gap), failed_requests,
outputs_identical, commit, cpus. No GPU is needed. ``--log-dir``: keep each node's serve
and worker logs under DIR/node0 and DIR/node1, and add ``killed_at`` (the kills' wall-clock
times, Unix seconds, to read the logs' timestamps against).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from bench._commit import commit
from elasticep.membership.election import lease_ttl_s
from elasticep.utils.wait import wait_until
from elasticep_testkit.etcd_cluster import EtcdCluster, leader_of
from elasticep_testkit.harness.load import Batch, RequestRecord
from elasticep_testkit.harness.serve_process import (
    ServeProcess,
    cli_command,
    coordinator_pids,
    descendant_pids,
    free_port,
)
from elasticep_testkit.prompts import gsm8k_questions

RESULTS_TIMEOUT_S = 180.0
STANDBY_WARMUP_S = 8.0  # a fresh replica imports torch before it can campaign


def leader_pid(roots: list[int], address: str) -> int:
    """The pid of the replica listening at ``address``: ``/proc/PID/net/tcp`` lists every
    socket of the network namespace, so the listener is matched against the replica's
    own file descriptors."""
    port = int(address.rpartition(":")[2])
    for pid in set().union(*(coordinator_pids(r) for r in roots)):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
            with open(f"/proc/{pid}/net/tcp") as f:
                rows = [ln.split() for ln in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            if state == "0A" and int(local.split(":")[1], 16) == port \
                    and f"socket:[{inode}]" in inodes:
                return pid
    raise LookupError(f"no replica listens at {address}")


def gap_across(records: list[RequestRecord], start: float, end: float) -> float:
    """The longest wait for a next token that overlaps ``[start, end]`` (seconds; a
    stream's wait for its first token counts too)."""
    longest = 0.0
    for r in records:
        times = [r.start, *r.token_times]
        for a, b in zip(times, times[1:], strict=False):
            if a <= end and b >= start:
                longest = max(longest, b - a)
    return longest


def one_run(serve: ServeProcess, url: str, roots: list[int], prompts: list[str],
            args: argparse.Namespace) -> dict:
    """Kill the leader under a burst of streams; the times (seconds from the kill), the
    kill's monotonic time and the burst's records."""
    wait_until(lambda: sum(len(coordinator_pids(r)) for r in roots) >= 2, 60,
               "a standby replica", poll_s=0.2)
    time.sleep(STANDBY_WARMUP_S)
    old = leader_of(url)
    victim = leader_pid(roots, old)
    b = Batch(serve.client, serve.model_name(), prompts, args.max_tokens)
    b.wait_tokens(args.concurrency * 4, 60)
    os.kill(victim, signal.SIGKILL)
    killed, killed_at = time.monotonic(), time.time()

    def elected() -> str | None:
        now = leader_of(url)
        return None if now in (None, old) else now

    new = wait_until(elected, 30, "a new leader", poll_s=0.02)
    failover_s = time.monotonic() - killed
    serve.wait_for(lambda s: s.membership_store is not None
                   and s.membership_store.leader == new
                   and len(s.healthy_ranks()) == args.ep_size, 60,
                   "the ranks back under the new leader", poll_s=0.05)
    resumed_s = time.monotonic() - killed
    return {"failover_s": failover_s, "resumed_s": resumed_s, "killed": killed,
            "killed_at": killed_at, "records": b.results(RESULTS_TIMEOUT_S)}


def node0_run(node1: ServeProcess, node0: ServeProcess, url: str, prompts: list[str],
              args: argparse.Namespace) -> dict:
    """SIGKILL node 0's whole process tree under a burst through node 1's front-end; the
    times (seconds from the kill), the kill's monotonic time and the burst's records."""
    old = leader_of(url)
    b = Batch(node1.client, node1.model_name(), prompts, args.max_tokens)
    b.wait_tokens(args.concurrency * 4, 60)
    for pid in {node0.proc.pid} | descendant_pids(node0.proc.pid):
        os.kill(pid, signal.SIGKILL)
    killed, killed_at = time.monotonic(), time.time()

    def elected() -> str | None:
        now = leader_of(url)
        return None if now in (None, old) else now

    wait_until(elected, 30, "a new leader", poll_s=0.02)
    failover_s = time.monotonic() - killed
    half = args.ep_size // 2
    node1.wait_for(lambda s: s.healthy_ranks() == list(range(half, args.ep_size)), 60,
                   "node 1's ranks serving without node 0's", poll_s=0.05)
    resumed_s = time.monotonic() - killed
    node0.proc.wait(10)
    return {"failover_s": failover_s, "resumed_s": resumed_s, "killed": killed,
            "killed_at": killed_at, "records": b.results(RESULTS_TIMEOUT_S)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill", choices=("leader", "node0"), default="leader",
                    help="the leader replica's process, or node 0's whole process tree")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--log-dir", help="keep the nodes' logs under DIR/node0 and DIR/node1")
    args = ap.parse_args()
    if args.kill == "node0":
        args.runs = 1  # node 0 does not come back
    ttl = lease_ttl_s(args.heartbeat_timeout)
    prompts = gsm8k_questions(args.concurrency, 110)
    out: dict = {"bench": "ha_failover", "kill": args.kill, "runs": args.runs, "ttl_s": ttl,
                 "ep_size": args.ep_size, "concurrency": args.concurrency}
    failover, resumed, gaps, healthy_gaps = [], [], [], []
    failed, identical, killed_at = 0, True, []
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir is not None:
        (log_dir / "node1").mkdir(parents=True, exist_ok=True)
    with EtcdCluster.start(3) as cluster:
        url = f"{cluster.url}/ha-bench"
        common = ["--ep-size", str(args.ep_size), "--nnodes", "2",
                  "--min-ep-size", str(args.ep_size // 2),
                  "--heartbeat-timeout", str(args.heartbeat_timeout),
                  "--coordinator-timeout", "30", "--membership-store", url]
        port1 = free_port()
        node1_log = Path(os.devnull) if log_dir is None else log_dir / "node1" / "serve.log"
        node1_args = [] if log_dir is None else ["--log-dir", str(node1_log.parent)]
        with open(node1_log, "w") as out1:
            node1 = ServeProcess(subprocess.Popen(
                cli_command("serve", *common, "--node-rank", "1", "--port", str(port1),
                            *node1_args),
                stdout=out1, stderr=subprocess.STDOUT, start_new_session=True),
                f"http://127.0.0.1:{port1}", "", node1_log)
        serve = None
        try:
            serve = ServeProcess.start([*common, "--node-rank", "0"], ready_timeout_s=300,
                                       log_dir=None if log_dir is None
                                       else str(log_dir / "node0"))
            roots = [serve.proc.pid, node1.proc.pid]
            # node 0's kill is seen on node 1's front-end
            client = node1 if args.kill == "node0" else serve
            client.wait_for(lambda s: len(s.healthy_ranks()) == args.ep_size, 60,
                            "every rank routable from this front-end")
            ref = Batch(client.client, client.model_name(), prompts,
                        args.max_tokens).results(RESULTS_TIMEOUT_S)
            reference = [r.text for r in ref]
            for r in ref:
                healthy_gaps += [b - a for a, b in zip(r.token_times, r.token_times[1:],
                                                       strict=False)]
            for _ in range(args.runs):
                run = (node0_run(node1, serve, url, prompts, args) if args.kill == "node0"
                       else one_run(serve, url, roots, prompts, args))
                failover.append(run["failover_s"])
                killed_at.append(round(run["killed_at"], 3))
                resumed.append(run["resumed_s"])
                failed += sum(not r.complete(args.max_tokens) for r in run["records"])
                identical &= [r.text for r in run["records"]] == reference
                gaps.append(gap_across(run["records"], run["killed"],
                                       run["killed"] + run["resumed_s"] + 1.0))
        finally:
            if node1.proc.poll() is None:
                node1.proc.send_signal(signal.SIGINT)
            if serve is not None and serve.proc.poll() is None:
                serve.stop()
            node1.stop()

    def summary(xs: list[float]) -> dict:
        return {"median": round(statistics.median(xs), 3), "max": round(max(xs), 3)}

    out.update(failover_s=summary(failover), resumed_s=summary(resumed),
               serving_gap_s=summary(gaps),
               p50_gap_s=round(statistics.median(healthy_gaps), 4),
               failed_requests=failed, outputs_identical=identical, commit=commit(),
               cpus=os.cpu_count())
    if log_dir is not None:
        out["killed_at"] = killed_at
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
