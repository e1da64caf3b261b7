"""A front-end on every node: two `elasticep serve` nodes on 127.0.0.1 with their
membership in a real 3-member etcd, each serving the API on its own port. Node 1's
front-end routes to every rank (node 0's included) before any fault; then every process
of node 0 (its serve, front-end, coordinator replica and ranks: the whole process tree)
is SIGKILLed while greedy streams run through node 1's front-end: every stream completes
with the fault-free text, node 1's replica leads, and node 1's ranks serve on, degraded."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from _serve_fixtures import RESULTS_TIMEOUT_S, assert_complete, burst, prompts, start_serve

from elasticep.membership.transitions import SlotState
from elasticep_testkit.etcd_cluster import EtcdCluster, leader_of
from elasticep_testkit.harness.serve_process import (
    ServeProcess,
    cli_command,
    descendant_pids,
    free_port,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

HB_TIMEOUT_S = 2.0
PROMPTS = prompts(4)
MAX_TOKENS = 16


def test_node1_front_end_serves_through_node0_host_death(tmp_path):
    with EtcdCluster.start(3) as cluster:
        url = f"{cluster.url}/every-node"
        common = ("--ep-size", "4", "--nnodes", "2", "--min-ep-size", "2",
                  "--heartbeat-timeout", str(HB_TIMEOUT_S), "--coordinator-timeout", "20",
                  "--membership-store", url)
        port1 = free_port()
        log_path = tmp_path / "node1.log"
        with open(log_path, "w") as log:  # finds the leader through etcd
            proc1 = subprocess.Popen(
                cli_command("serve", *common, "--node-rank", "1", "--port", str(port1),
                            "--log-dir", str(tmp_path)),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node1 = ServeProcess(proc1, f"http://127.0.0.1:{port1}", "", log_path)
        node0, tree = None, set()
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

            b = burst(node1, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            tree = {node0.proc.pid} | descendant_pids(node0.proc.pid)
            for pid in tree:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference

            st = node1.wait_for(lambda s: s.healthy_ranks() == [2, 3]
                                and s.rank(0).state == SlotState.FAILED, 20,
                                "node 0's ranks failed on node 1's front-end")
            assert leader_of(url) == st.membership_store.leader != node0.coordinator
            after = burst(node1, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(after, MAX_TOKENS)
            assert [r.text for r in after] == reference
            node1.wait_for(lambda s: sorted(node1.status_json()["frontends"]) == ["node1"],
                           10, "node 0's front-end gone from the directory")
            assert time.monotonic() - killed_at < 40
        finally:
            if node0 is not None and not tree:
                node0.stop()
            elif node0 is not None:  # SIGKILLed: its status names node 1's live ranks too,
                node0.proc.wait(10)  # so its stop() would wait for them and kill them
            node1.stop()
