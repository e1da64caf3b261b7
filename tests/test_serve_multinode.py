"""Two `elasticep serve` nodes on one machine over 127.0.0.1: node 0 runs the coordinator,
the API and ranks 0-1; node 1 only launches ranks 2-3 with the settings of node 0."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from _serve_fixtures import RESULTS_TIMEOUT_S, assert_complete, burst, prompts, start_serve

from elasticep.membership.transitions import SlotState
from elasticep.utils.procs import pid_alive
from elasticep.utils.wait import wait_until
from elasticep_testkit.harness.serve_process import cli_command, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPTS = prompts(4)


def test_two_nodes_serve_and_survive_a_remote_rank_death(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    node1_log = open(tmp_path / "node1.log", "w")  # noqa: SIM115
    # node 1 first: it waits for the coordinator that node 0 is about to bind
    node1 = subprocess.Popen(cli_command("serve", "--ep-size", "4", "--nnodes", "2", "--node-rank", "1",
                                 "--dist-init-addr", coord, "--heartbeat-timeout", "3.0",
                                 "--coordinator-timeout", "15"),
                             stdout=node1_log, stderr=subprocess.STDOUT, start_new_session=True)
    serve = None
    try:
        serve = start_serve("--ep-size", "4", "--nnodes", "2", "--node-rank", "0",
                            "--heartbeat-timeout", "3.0", "--max-total-tokens", "2048",
                            coordinator=coord)
        st = serve.status()
        assert [(r.rank, r.node, r.state) for r in st.ranks] == [
            (0, 0, "healthy"), (1, 0, "healthy"), (2, 1, "healthy"), (3, 1, "healthy")]
        first = burst(serve, PROMPTS, 16).results(RESULTS_TIMEOUT_S)
        assert_complete(first, 16)
        reference = [r.text for r in first]
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
        assert node1.wait(45) == 1, (tmp_path / "node1.log").read_text()[-3000:]
        log = (tmp_path / "node1.log").read_text()
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
