"""Standby coordinators and a front-end on every node: two `elasticep serve` nodes on
127.0.0.1 with their membership in a real 3-member etcd.

- The leader coordinator process (node 0's) is SIGKILLed while greedy streams run:
  every stream completes with the fault-free text, node 1's standby replica leads within
  the lease TTL + 1 s, the ranks resume with it in place (same pids, no new epoch), and
  a rank kill afterwards is still survived (its new epoch rendezvouses on the new
  leader's store).
- Each node serves the API on its own port. Node 1's front-end routes to every rank
  (node 0's included) before any fault; then every process of node 0 (its serve,
  front-end, coordinator replica and ranks: the whole process tree) is SIGKILLed while
  greedy streams run through node 1's front-end: every stream completes with the
  fault-free text, node 1's replica leads, node 0's ranks fail at the takeover (their
  etcd keys are gone) and node 1's ranks serve on, degraded."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from _serve_fixtures import (
    RESULTS_TIMEOUT_S,
    assert_complete,
    burst,
    etcd_two_node_args,
    prompts,
    start_serve,
)

from elasticep.membership.election import lease_ttl_s
from elasticep.membership.transitions import SlotState
from elasticep_testkit.etcd_cluster import EtcdCluster, leader_of
from elasticep_testkit.harness.serve_process import (
    ServeProcess,
    cli_command,
    coordinator_pids,
    descendant_pids,
    free_port,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

HB_TIMEOUT_S = 2.0
TTL_S = lease_ttl_s(HB_TIMEOUT_S)
PROMPTS = prompts(4)
MAX_TOKENS = 16


def test_the_leader_coordinator_dies_under_load_and_nothing_fails(tmp_path):
    with EtcdCluster.start(3) as cluster:
        url = f"{cluster.url}/failover"
        common = etcd_two_node_args(url, HB_TIMEOUT_S)
        with open(tmp_path / "node1.log", "w") as log:  # finds the leader through etcd
            node1 = subprocess.Popen(cli_command("serve", *common, "--node-rank", "1",
                                                 "--port", str(free_port())),
                                     stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        serve = None
        try:
            serve = start_serve(*common, "--node-rank", "0", "--max-total-tokens", "2048")
            first = burst(serve, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(first, MAX_TOKENS)
            reference = [r.text for r in first]
            before = serve.status()
            old = leader_of(url)
            assert old == serve.coordinator == before.membership_store.leader
            (killed,) = coordinator_pids(serve.proc.pid)
            assert coordinator_pids(node1.pid), "node 1 runs no standby replica"

            b = burst(serve, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            os.kill(killed, signal.SIGKILL)
            killed_at = time.monotonic()
            while (new := leader_of(url)) in (None, old) and time.monotonic() - killed_at < 10:
                time.sleep(0.05)
            took = time.monotonic() - killed_at
            assert new not in (None, old) and took <= TTL_S + 1, (new, took)
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference

            # the ranks are back with the new leader as they were: same pids, same epoch
            after = serve.wait_for(lambda s: s.membership_store is not None
                                   and s.membership_store.leader == new
                                   and s.healthy_ranks() == [0, 1, 2, 3], 20,
                                   "the ranks to resume with the new leader")
            assert after.epoch == before.epoch
            assert [r.pid for r in after.ranks] == [r.pid for r in before.ranks]
            assert "lost the coordinator at" in serve.rank_log(0)
            # node 0 keeps serving and runs a fresh standby in place of the dead replica
            assert serve.proc.poll() is None
            serve.wait_for(lambda s: bool(coordinator_pids(serve.proc.pid) - {killed}), 20,
                           "node 0's replacement replica")

            # a rank kill after the failover is survived as before
            victim = serve.rank_state(3)
            b = burst(serve, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            os.kill(victim.pid, signal.SIGKILL)
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference
            st = serve.wait_for(lambda s: s.rank(3).state == SlotState.FAILED, 10,
                                "rank 3 failed")
            assert st.epoch > after.epoch and st.healthy_ranks() == [0, 1, 2]
        finally:
            # node 1 first: the leader is its replica now, and its ranks serve on after
            # node 0 stops (serve.stop waits for every rank pid it saw)
            if node1.poll() is None:
                node1.send_signal(signal.SIGINT)
            if serve is not None:
                serve.stop()
            if node1.poll() is None:
                try:
                    node1.wait(30)
                except subprocess.TimeoutExpired:
                    node1.kill()
                    node1.wait(10)


def test_node1_front_end_serves_through_node0_host_death(tmp_path):
    with EtcdCluster.start(3) as cluster:
        url = f"{cluster.url}/every-node"
        common = etcd_two_node_args(url, HB_TIMEOUT_S)
        port1 = free_port()
        log_path = tmp_path / "node1.log"
        with open(log_path, "w") as log:  # finds the leader through etcd
            proc1 = subprocess.Popen(
                cli_command("serve", *common, "--node-rank", "1", "--port", str(port1),
                            "--log-dir", str(tmp_path)),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node1 = ServeProcess(proc1, f"http://127.0.0.1:{port1}", "", log_path)
        node0, back, tree = None, None, set()
        try:
            node0 = start_serve(*common, "--node-rank", "0", "--max-total-tokens", "2048")
            # node 1's API routes to every rank once each said hello to it
            node1.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3]
                           and node1.printed_ready(), 30, "node 1's API ready")
            first = burst(node1, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(first, MAX_TOKENS)
            reference = [r.text for r in first]
            by_node0 = burst(node0, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert [r.text for r in by_node0] == reference
            # every rank said hello to node 1's front-end on its own link (the hello
            # carries the rank's KV capacity, which the status shows)
            hellos = node1.status()
            assert [r.max_total_tokens is not None for r in hellos.ranks] == [True] * 4
            body = node1.status_json()
            assert sorted(body["frontends"]) == ["node0", "node1"], body["frontends"]
            assert len(body["coordinator_replicas"]) == 2, body["coordinator_replicas"]
            metrics = node1.metrics()
            assert f'elasticep_frontend{{frontend="node1",url="{node1.url}"}} 1.0' in metrics
            assert metrics.count("elasticep_coordinator_replica{") == 2

            b = burst(node1, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            tree = {node0.proc.pid} | descendant_pids(node0.proc.pid)
            for pid in tree:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference

            after_kill = node1.wait_for(lambda s: s.healthy_ranks() == [2, 3]
                                        and s.rank(0).state == SlotState.FAILED, 20,
                                        "node 0's ranks failed on node 1's front-end")
            leader = after_kill.membership_store.leader
            assert leader_of(url) == leader != node0.coordinator
            # failed at the takeover, as their etcd keys went (takeover.py), not after
            # a heartbeat timeout on top of the lease TTL
            coordinator_log = log_path.read_text()
            assert coordinator_log.count("dead: its process left etcd's list of ranks") == 2
            assert "not back after the leader change" not in coordinator_log
            after = burst(node1, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(after, MAX_TOKENS)
            assert [r.text for r in after] == reference
            node1.wait_for(lambda s: sorted(node1.status_json()["frontends"]) == ["node1"],
                           10, "node 0's front-end gone from the directory")
            assert time.monotonic() - killed_at < 40

            # node 0's serve run again takes its slots back in place, with its own API
            back = start_serve(*common, "--node-rank", "0")
            assert "this node 0 takes its slots back" in back.tail()
            assert [r.text for r in burst(back, PROMPTS, MAX_TOKENS).results(
                RESULTS_TIMEOUT_S)] == reference
            st = node1.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3], 20,
                                "node 0's ranks readmitted on node 1's front-end")
            assert st.epoch > after_kill.epoch
            assert [r.text for r in burst(node1, PROMPTS, MAX_TOKENS).results(
                RESULTS_TIMEOUT_S)] == reference
        finally:
            # each node's status names the other's ranks, which its stop() waits for (and
            # then kills): every serve is told to stop before any is waited for
            live = [p for p in (node0, back, node1) if p is not None and p.proc.poll() is None]
            for p in live:
                p.proc.send_signal(signal.SIGINT)
            for p in live:
                p.stop()
            if node0 is not None and tree:
                node0.proc.wait(10)
