"""A node's planned stop under etcd (``deploy/planned_leave.py``) against a stand-in
deployment: the retirement is asked for the live ranks by rank, once more with the same
operation id when the first call finds the old leader gone, and the stop goes on
without waiting when the leader refuses or the other nodes stop too. The whole flow on
two serve nodes: tests/test_serve_leader_failover.py."""

import time

from elasticep.deploy.planned_leave import leave_on_purpose
from elasticep.membership.errors import ScaleRefusedError
from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import SlotState


class Launcher:
    """Answers ``call`` with ``answers`` in turn (an exception is raised)."""

    def __init__(self, answers, on_retire=None) -> None:
        self.answers, self.on_retire, self.retires = list(answers), on_retire, []

    def call(self, request):
        return request(self)

    def retire(self, ranks=None, node=None, operation_id=None, keep_processes=False):
        self.retires.append((ranks, operation_id))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if self.on_retire is not None:
            self.on_retire()
        return answer


class Node:
    """This node's deployment: ranks 0 and 1 (their processes), node 0."""

    def __init__(self, launcher: Launcher, others_healthy: bool = True,
                 ours: SlotState = SlotState.DRAINING) -> None:
        self.node, self.launcher, self.live = 0, launcher, {0: 100, 1: 101}
        self.others_healthy, self.ours = others_healthy, ours

    def pids(self, live_only: bool = False) -> dict[int, int]:
        return dict(self.live)

    def deployment_status(self) -> DeploymentStatus:
        other = SlotState.HEALTHY if self.others_healthy else SlotState.FAILED
        return DeploymentStatus(1, 4, 4, ranks=(
            RankStatus(0, self.ours), RankStatus(1, SlotState.DRAINING),
            RankStatus(2, other), RankStatus(3, other)))


def test_the_retirement_is_asked_again_with_the_same_id_after_a_lost_leader():
    node = Node(Launcher([ConnectionError("closed"), {"slots": [0, 1]}]))
    node.launcher.on_retire = node.live.clear  # the ranks leave at once
    assert leave_on_purpose(node, timeout_s=2)
    (first, op1), (second, op2) = node.launcher.retires
    assert first == second == [0, 1] and op1 == op2 and op1.startswith("stop-node0-")


def test_a_refusal_or_the_others_stopping_too_ends_the_wait():
    node = Node(Launcher([ScaleRefusedError("would leave no healthy rank")]))
    assert not leave_on_purpose(node, timeout_s=30)
    assert len(node.launcher.retires) == 1 and node.live  # nothing waited for
    node = Node(Launcher([{"slots": [0, 1]}]), others_healthy=False)
    started = time.monotonic()
    assert not leave_on_purpose(node, timeout_s=30)
    assert time.monotonic() - started < 5  # within a look at the status, not 30 s


def test_a_node_whose_ranks_are_still_joining_stops_without_a_retirement():
    """Ctrl-C while the node's relaunched ranks rejoin: no retirement is asked (it would
    race their admission and shrink the deployment under them)."""
    node = Node(Launcher([{"slots": [0, 1]}]), ours=SlotState.JOINING)
    assert not leave_on_purpose(node, timeout_s=2)
    assert node.launcher.retires == []
