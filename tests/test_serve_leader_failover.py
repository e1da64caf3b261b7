"""Standby coordinators: two `elasticep serve` nodes on 127.0.0.1 with their membership
in a real 3-member etcd. The leader coordinator process (node 0's) is SIGKILLed while
greedy streams run: every stream completes with the fault-free text, node 1's standby
replica leads within the lease TTL + 1 s, the ranks resume with it in place (same pids,
no new epoch), and a rank kill afterwards is still survived (its new epoch rendezvouses
on the new leader's store). Then node 0's serve is stopped on purpose (Ctrl-C) under
node 1's leader: its ranks leave as a planned removal (no death at the leader, slots
retired, not failed) and node 1 serves on alone with the fault-free texts.

Whole-host faults (node 0's host killed, the leader's host partitioned) are in
``tests/test_ha_host_faults.py``, on network-namespace hosts."""

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
        port1 = free_port()
        with open(tmp_path / "node1.log", "w") as log:  # finds the leader through etcd
            node1 = subprocess.Popen(cli_command("serve", *common, "--node-rank", "1",
                                                 "--port", str(port1)),
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
            victim = serve.rank_state(1)
            b = burst(serve, PROMPTS, MAX_TOKENS)
            assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
            os.kill(victim.pid, signal.SIGKILL)
            results = b.results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference
            st = serve.wait_for(lambda s: s.rank(1).state == SlotState.FAILED, 10,
                                "rank 1 failed")
            assert st.epoch > after.epoch and st.healthy_ranks() == [0, 2, 3]

            # node 0 stopped on purpose under node 1's leader: a planned departure
            rank0 = st.rank(0).pid
            assert serve.interrupt() == 130
            assert "its ranks left after their planned removal" in serve.tail()
            node1_api = ServeProcess(node1, f"http://127.0.0.1:{port1}", "",
                                     tmp_path / "node1.log")
            left = node1_api.wait_for(lambda s: s.rank(0).state == SlotState.FREE
                                      and s.healthy_ranks() == [2, 3], 10,
                                      "node 0's slots retired")
            assert left.rank(1).state == SlotState.FAILED  # its death was a failure
            log1 = (tmp_path / "node1.log").read_text(errors="replace")
            assert f"rank 0 (pid {rank0}) left after its planned removal" in log1
            assert f"rank 0 (pid {rank0}) dead" not in log1
            results = burst(node1_api, PROMPTS, MAX_TOKENS).results(RESULTS_TIMEOUT_S)
            assert_complete(results, MAX_TOKENS)
            assert [r.text for r in results] == reference
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

