"""Requests that would empty the deployment are refused (issue 30, item 4): a scale-down
that keeps no healthy rank gets a 409 with one line."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from elasticep.distributed.errors import ScaleRefusedError
from elasticep.distributed.membership import SlotState
from elasticep.distributed.scaling import ScaleTarget
from elasticep.distributed.status import DeploymentStatus
from elasticep.engine.ipc import FrontendChannel
from elasticep.frontend.http_server import create_server

pytestmark = pytest.mark.timeout(60)

DEMO = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"


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

    def scale(self, new_ep_size: int) -> dict:
        return self.target.plan(new_ep_size, self.states).reply


def test_http_answers_409_with_one_line():
    channel = FrontendChannel()
    membership = TargetMembership()
    server, _ = create_server(DEMO, channel, membership, served_model_name="tiny")
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
