"""Two `elasticep serve` nodes on one machine over 127.0.0.1: node 0 runs the coordinator,
the API and ranks 0-1; node 1 only launches ranks 2-3 with the settings of node 0.

The node is drained, its `serve` exits, and the same `serve` run again takes its slots
back in place (as an orchestrator replacing a pod does); then a remote rank dies."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
from _serve_fixtures import RESULTS_TIMEOUT_S, assert_complete, burst, prompts, start_serve

from elasticep.membership.transitions import SlotState
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.serve_process import cli_command, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = prompts(4)


def _node1(coord: str, log_path) -> subprocess.Popen:
    """`serve --node-rank 1` (the same flags every time it is started)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cli_command(
            "serve", "--ep-size", "4", "--nnodes", "2", "--node-rank", "1", "--min-ep-size", "2",
            "--dist-init-addr", coord, "--heartbeat-timeout", "3.0",
            "--coordinator-timeout", "15"),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_two_nodes_serve_drain_rejoin_and_survive_a_remote_rank_death(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    # node 1 first: it waits for the coordinator that node 0 is about to bind
    node1 = _node1(coord, tmp_path / "node1.log")
    serve = None
    try:
        serve = start_serve("--ep-size", "4", "--nnodes", "2", "--node-rank", "0",
                            "--min-ep-size", "2",
                            "--heartbeat-timeout", "3.0", "--max-total-tokens", "2048",
                            coordinator=coord)
        st = serve.status()
        assert [(r.rank, r.node, r.state) for r in st.ranks] == [
            (0, 0, "healthy"), (1, 0, "healthy"), (2, 1, "healthy"), (3, 1, "healthy")]
        first = burst(serve, PROMPTS, 16).results(RESULTS_TIMEOUT_S)
        assert_complete(first, 16)
        reference = [r.text for r in first]
        # drain node 1 under load: its requests move to node 0, its serve exits 0 once
        # its ranks left
        b = burst(serve, PROMPTS, 16)
        assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
        url = f"{serve.url}/scale_elastic_ep"
        r = httpx.post(url, json={"drain_node": 1, "operation_id": "drain-1"}, timeout=30)
        assert r.status_code == 200 and r.json()["slots"] == [2, 3], r.text
        assert [x.text for x in b.results(RESULTS_TIMEOUT_S)] == reference
        wait_until(lambda: httpx.get(f"{url}/drain-1", timeout=10).json()["phase"] == "done",
                   60, "node 1 safe to terminate", poll_s=0.1)
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
        assert serve.status().healthy_ranks() == [0, 1]
        # the same serve again: it takes ranks 2 and 3 back in place
        node1 = _node1(coord, tmp_path / "node1-again.log")
        b = burst(serve, PROMPTS, 16)
        serve.wait_for(lambda s: s.healthy_ranks() == [0, 1, 2, 3] and s.ep_size == 4,
                       120, "node 1 back")
        assert [x.text for x in b.results(RESULTS_TIMEOUT_S)] == reference
        assert "rejoins ranks [2, 3] in place" in (tmp_path / "node1-again.log").read_text()
        victim = serve.rank_state(3)
        b = burst(serve, PROMPTS, 16)
        assert b.wait_tokens(8, 60), f"only {b.tokens()} tokens arrived"
        os.kill(victim.pid, signal.SIGKILL)
        results = b.results(RESULTS_TIMEOUT_S)
        assert_complete(results, 16)
        assert [r.text for r in results] == reference
        serve.wait_for(lambda s: s.rank(3).state == SlotState.FAILED, 10, "rank 3 failed")
        pids = (serve.seen_pids | serve.note_descendants()) - {serve.proc.pid}
        assert serve.interrupt(timeout_s=30) == 130  # Ctrl-C: 128 + SIGINT
        # node 1's ranks lose the coordinator and stop; node 1 tries to reach it for
        # --coordinator-timeout, then exits non-zero with one line saying so
        assert node1.wait(45) == 1, (tmp_path / "node1-again.log").read_text()[-3000:]
        log = (tmp_path / "node1-again.log").read_text()
        assert "exited with 3; relaunch it with" not in log, log[-3000:]  # no vain hints
        last = [ln for ln in log.splitlines() if ln.strip()][-1]
        assert last.startswith("elasticep serve: error: node 1: lost the coordinator: no "
                               f"coordinator answered at --dist-init-addr {coord} within 15 s"), last
        wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "every process to exit",
                   poll_s=0.1, last=lambda: sorted(p for p in pids if pid_alive(p)))
    finally:
        if serve is not None:
            serve.stop()
        if node1.poll() is None:
            node1.send_signal(signal.SIGINT)
            node1.wait(30)
