"""Retiring ranks with ``"keep_processes": true`` through the membership service (no
sockets): the retired workers are told to stay up, the operation is done once they are
out of the group (safe to terminate, their idle process still running), and their slot
is refused to a `join` until they are stopped. Without it, as before: the operation
waits for the workers to exit."""

from __future__ import annotations

import pytest
from test_retire_ranks import SUP, _deployment, _ok, _refused, _remove_voted

from elasticep.membership.messages import ClearLaunch, GetOperation, Reserve, Retire
from elasticep.membership.transitions import SlotState

pytestmark = pytest.mark.timeout(30)


def _op(svc, op_id: str) -> dict:
    return _ok(svc, SUP, GetOperation(op_id, id=9))["operation"]


def test_keep_processes_leaves_the_retired_workers_up_and_the_operation_done():
    svc = _deployment(4, {r: 0 for r in range(4)}, min_holding=1)
    g = svc.group("world")
    reply = _ok(svc, SUP, Retire(ranks=[3], operation_id="keep", keep_processes=True,
                                 id=10))
    assert reply["slots"] == [3] and reply["scale_phase"] == "draining"
    # the removed rank reads the keep request in the same push as its removal
    assert g.requests["remove"] == [3] and g.requests["keep"] == [3]
    # keep_processes is part of the request: the same id without it is another request
    assert _refused(svc, Retire(ranks=[3], operation_id="keep", id=11)).code == (
        "operation_conflict")
    assert _ok(svc, SUP, Retire(ranks=[3], operation_id="keep", keep_processes=True,
                                id=12))["repeated"] is True
    _remove_voted(svc, [3])
    assert g.states[3] == SlotState.FREE and g.requests["keep"] == [3]
    # out of the group, its worker idles (still connected, still launched): done
    assert _op(svc, "keep") == {
        "operation_id": "keep", "request": {"retire_ranks": [3], "keep_processes": True},
        "phase": "done", "ranks": [{"rank": 3, "state": "safe_to_terminate",
                                    "process_running": True}]}
    # the same slot's worker, retired without keep_processes, reads `retired` until it
    # exits: the operation waits for it
    _ok(svc, SUP, Retire(ranks=[2], operation_id="exit", id=13))
    assert "keep" not in g.requests or 2 not in g.requests["keep"]
    _remove_voted(svc, [2])
    assert _op(svc, "exit")["phase"] == "retiring"
    assert _op(svc, "exit")["ranks"] == [{"rank": 2, "state": "retired"}]
    svc.closed(2)
    _ok(svc, SUP, ClearLaunch(2, 102, id=14))
    assert _op(svc, "exit")["ranks"] == [{"rank": 2, "state": "safe_to_terminate"}]
    # a kept worker holds its slot: a join is refused until it is stopped
    refused = _refused(svc, Reserve([3], "recover", "join pid 9", id=15))
    assert "worker (pid 103) still runs" in refused.error
    svc.closed(3)  # the orchestrator stopped it
    _ok(svc, SUP, ClearLaunch(3, 103, id=16))
    assert _op(svc, "keep")["ranks"] == [{"rank": 3, "state": "safe_to_terminate",
                                          "process_running": False}]
    _ok(svc, SUP, Reserve([3], "recover", "join pid 9", id=17))
