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
