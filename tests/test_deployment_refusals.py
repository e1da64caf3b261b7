"""Requests that would empty the deployment are refused (issue 30, item 4): a scale-down
that keeps no healthy rank gets a 409 with one line, and a node whose ``--nnodes`` or
``--ep-size`` disagrees with node 0's exits 2 at once, naming both values."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import replace

import httpx
import pytest

from elasticep.config import DeploymentConfig
from elasticep.entrypoints.serve_node import layout_mismatch
from elasticep.frontend.http_server import create_server
from elasticep.frontend_link import FrontendChannel
from elasticep.membership.errors import ScaleRefusedError
from elasticep.membership.scaling import ScaleTarget
from elasticep.membership.status import DeploymentStatus
from elasticep.membership.transitions import SlotState
from elasticep_testkit.harness.serve_process import cli_command, free_port
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)


def _states(*names: str) -> list[SlotState]:
    return [SlotState(n) for n in names]


def test_a_shrink_that_keeps_no_healthy_rank_is_refused_and_changes_nothing():
    t = ScaleTarget(2, 2)
    with pytest.raises(ScaleRefusedError) as info:
        t.plan(1, _states("failed", "healthy"))  # the case: rank 0 failed
    assert str(info.value) == ("new_ep_size 1 would leave no healthy rank (rank 0 is "
                               "failed; it would remove the healthy ranks [1])")
    assert t.ep_size == 2 and not t.down
    t = ScaleTarget(4, 4)
    with pytest.raises(ScaleRefusedError, match=r"rank 0 is failed, rank 1 is joining"):
        t.plan(2, _states("failed", "joining", "healthy", "healthy"))
    # one healthy rank kept is enough: the survivors reload what the drained ranks held
    plan = t.plan(2, _states("failed", "healthy", "healthy", "healthy"))
    assert plan.remove == (2, 3) and t.ep_size == 2


class TargetMembership:
    """Two ranks, rank 0 failed; ``scale`` runs the coordinator's real ScaleTarget."""

    def __init__(self) -> None:
        self.target = ScaleTarget(2, 2)
        self.states = _states("failed", "healthy")

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(
            {"epoch": 1, "ep_size": self.target.ep_size, "max_ep_size": 2,
             "scale_phase": "idle",
             "ranks": [{"rank": r, "state": s.value, "pid": None, "node": 0}
                       for r, s in enumerate(self.states)]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        return self.target.plan(new_ep_size, self.states).reply


def test_http_answers_409_with_one_line():
    channel = FrontendChannel()
    membership = TargetMembership()
    server, _ = create_server(DEMO_MODEL, channel, membership, served_model_name="tiny")
    server.start()
    try:
        r = httpx.post(server.url + "/scale_elastic_ep", json={"new_ep_size": 1})
        error = r.json()["error"]
        assert r.status_code == 409 and error["code"] == "scale_refused"
        assert "\n" not in error["message"] and "no healthy rank" in error["message"]
        assert membership.target.ep_size == 2
    finally:
        server.stop()
        channel.close()


# ---- a node whose layout disagrees with node 0's ----------------------------------------
def test_layout_mismatch_names_both_values():
    node0 = DeploymentConfig(model="m", ep_size=4, max_ep_size=4, nnodes=2)
    assert layout_mismatch(replace(node0), node0, "h:1") is None
    assert layout_mismatch(replace(node0, nnodes=4), node0, "h:1") == (
        "--nnodes 4 disagrees with node 0's --nnodes 2 (the deployment at h:1); start "
        "every node with the same --nnodes")
    assert layout_mismatch(replace(node0, ep_size=8, max_ep_size=8), node0, "h:1").startswith(
        "--ep-size 8 disagrees with node 0's --ep-size 4")


@pytest.mark.timeout(180)
def test_a_node_with_another_nnodes_is_refused_at_once(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    logs = [open(tmp_path / f"node{n}.log", "w") for n in (0, 1)]  # noqa: SIM115
    node0 = subprocess.Popen(cli_command("serve", "--ep-size", "4", "--nnodes", "2",
                                         "--node-rank", "0", "--dist-init-addr", coord,
                                         "--port", str(free_port()), "--log-dir",
                                         str(tmp_path)),
                             stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        node1 = subprocess.run(cli_command("serve", "--ep-size", "4", "--nnodes", "4",
                                           "--node-rank", "1", "--dist-init-addr", coord,
                                           "--coordinator-timeout", "60"),
                               capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert node1.returncode == 2, node1.stdout + node1.stderr
        lines = [ln for ln in node1.stderr.splitlines() if ln.strip()]
        assert lines[-1] == (f"elasticep serve: error: node 1: --nnodes 4 disagrees with "
                             f"node 0's --nnodes 2 (the deployment at {coord}); start every "
                             "node with the same --nnodes"), node1.stderr
        assert "ready:" not in node1.stdout and took < 100
    finally:
        node0.send_signal(signal.SIGINT)
        try:
            node0.wait(60)
        except subprocess.TimeoutExpired:
            node0.kill()
            node0.wait(10)
        for f in logs:
            f.close()
