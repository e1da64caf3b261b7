"""What ``elasticep_scale_seconds`` counts, through the HTTP routes over the real
membership service (no sockets, no ranks): a grow that a later request superseded is
not a grow, and a request for the size the deployment has is no scale at all."""

from __future__ import annotations

import httpx
import pytest
from test_retire_ranks import SUP, _growable, _ok, scale_routes

from elasticep.membership.messages import Scale

pytestmark = pytest.mark.timeout(30)


def _scale_counts(server) -> dict[str, float]:
    """kind -> elasticep_scale_seconds_count."""
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(
        httpx.get(server.url + "/metrics").text)}
    return {s.labels["kind"]: s.value for s in fams["elasticep_scale_seconds"].samples
            if s.name.endswith("_count")}


def test_the_coordinator_names_the_operations_a_request_superseded():
    from elasticep.membership.client import CoordinatorClient
    from elasticep.membership.messages import Reply

    svc = _growable(4, 6)
    assert "superseded" not in _ok(svc, SUP, Scale(6, operation_id="grow", id=3))
    reply = [s.msg for s in svc.handle(SUP, Scale(4, operation_id="back", id=4))
             if isinstance(s.msg, Reply)][-1]
    assert reply.ok and reply.body["superseded"] == ["grow"]
    # and the client the front-end talks through passes it on
    assert CoordinatorClient._operation_reply(reply)["superseded"] == ["grow"]


def test_a_superseded_grow_is_not_timed_as_a_grow(tmp_path):
    """Grow 3 -> 4 with no joiner, then back to 3: the grow never finished; it is
    logged as superseded, and only the shrink that replaced it is timed."""
    from elasticep.frontend.event_log import EventLog, read_events

    with scale_routes(_growable(3, 4)) as (server, frontend):
        frontend.event_log = EventLog(tmp_path / "events.jsonl")
        url = server.url + "/scale_elastic_ep"
        assert httpx.post(url, json={"new_ep_size": 4, "operation_id": "g"}).status_code == 200
        back = httpx.post(url, json={"new_ep_size": 3})
        assert back.status_code == 200 and back.json()["superseded"] == ["g"], back.text
        assert httpx.get(url + "/g").json()["phase"] == "superseded"
        assert _scale_counts(server) == {"shrink": 1.0}
        frontend.event_log.close()
    events = [(e["event"], e.get("kind"), e.get("operation_id"))
              for e in read_events(tmp_path / "events.jsonl") if "scale" in e["event"]]
    assert events == [("scale_requested", "grow", "g"), ("scale_requested", "shrink", "op-1"),
                      ("scale_superseded", "grow", "g"), ("scale_done", "shrink", "op-1")]


def test_a_request_for_the_current_size_is_no_scale(tmp_path):
    from elasticep.frontend.event_log import EventLog, read_events

    with scale_routes(_growable(3, 4)) as (server, frontend):
        frontend.event_log = EventLog(tmp_path / "events.jsonl")
        url = server.url + "/scale_elastic_ep"
        r = httpx.post(url, json={"new_ep_size": 3, "operation_id": "same"})
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "unchanged", "new_ep_size": 3, "old_ep_size": 3,
                            "slots": [], "scale_phase": "idle", "operation_id": "same",
                            "message": "ep_size is 3 already: nothing to do"}
        assert httpx.get(url + "/same").json()["phase"] == "done"
        assert _scale_counts(server) == {}
        # a real scale after it is one as usual
        r = httpx.post(url, json={"new_ep_size": 2})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
        frontend.event_log.close()
    assert [(e["event"], e.get("kind")) for e in read_events(tmp_path / "events.jsonl")
            if "scale" in e["event"]] == [("scale_requested", "shrink")]


def test_a_grow_that_timed_out_is_not_timed_as_a_grow():
    """Grow 4 -> 6, one joiner admitted, the other never came: past the scale timeout
    the deployment is idle at 5. That grow did not finish as asked: it ends as
    scale_timed_out, and no histogram observes it; a grow that got all it asked does."""
    from elasticep.frontend.metrics import FrontendMetrics
    from elasticep.frontend.recovery_timeline import RecoveryTimeline
    from elasticep.membership.status import DeploymentStatus

    def status(ep_size: int, phase: str) -> DeploymentStatus:
        return DeploymentStatus.from_dict({"epoch": 1, "ep_size": ep_size, "max_ep_size": 6,
                                           "scale_phase": phase, "ranks": []})

    tl, m = RecoveryTimeline(), FrontendMetrics()
    events = tl.on_status(0.0, status(4, "idle"))
    events += tl.on_scale(1.0, "grow", {"operation_id": "g", "old_ep_size": 4,
                                        "slots": [4, 5]})
    events += tl.on_status(2.0, status(6, "waiting_for_joiners"))
    events += tl.on_status(31.0, status(5, "idle"))
    events += tl.on_scale(40.0, "grow", {"operation_id": "h", "old_ep_size": 5, "slots": [5]})
    events += tl.on_status(45.0, status(6, "idle"))
    for e in events:
        m.observe(e)
    assert [(e.name, e.attrs.get("operation_id"), e.seconds) for e in events
            if e.seconds is not None] == [("scale_timed_out", "g", 30.0),
                                          ("scale_done", "h", 5.0)]
    text = m.render()[0].decode()
    assert 'elasticep_scale_seconds_count{kind="grow"} 1.0' in text
    assert 'elasticep_scale_seconds_sum{kind="grow"} 5.0' in text
