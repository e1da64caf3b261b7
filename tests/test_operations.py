"""What ships for operators: the Grafana dashboard (every metric it queries exists in
/metrics), the Kubernetes example (valid against the Kubernetes schemas), the timeline
plot of an event log, the recovery timeline's phases, and who may read /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from elasticep.frontend.event_log import EventLog, read_events
from elasticep.frontend.http_guards import ApiKeyMiddleware
from elasticep.frontend.metrics import FrontendMetrics
from elasticep.frontend.recovery_timeline import RecoveryTimeline
from elasticep.membership.status import DeploymentStatus

pytestmark = pytest.mark.timeout(60)

OPS = Path(__file__).resolve().parents[1] / "docs" / "operations"


def _exposed_names() -> set[str]:
    """Every sample name /metrics can show (a histogram's _bucket/_sum/_count, a
    counter's _total), from the front-end's registry with one of each labelled child."""
    m = FrontendMetrics()
    m.rank_stats(0, 1, 1, 1)
    m.rank_experts_held.labels("0").set(1)
    for hist, label in ((m.death_phase_seconds, "agreed"), (m.rejoin_phase_seconds, "loaded"),
                        (m.scale_seconds, "grow")):
        hist.labels(label).observe(0.1)
    m.requests_resumed.labels("failure").inc()
    m.requests.labels("chat", "ok").inc()
    m.slots.labels("healthy").set(1)
    m.rank_state.labels("0", "healthy").set(1)
    m.rank_node.labels("0").set(0)
    text = m.render()[0].decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_metric_the_dashboard_queries_exists():
    dash = json.loads((OPS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\belasticep_[a-z0-9_]+", e)}
    assert len(queried) >= 15, queried
    assert queried - _exposed_names() == set()
    # it shows what an operator asked for: states over time, recovery phases, tokens/s,
    # TTFT and TPOT
    for name in ("elasticep_rank_state", "elasticep_death_phase_seconds_bucket",
                 "elasticep_rejoin_phase_seconds_bucket", "elasticep_generation_tokens_total",
                 "elasticep_time_to_first_token_seconds_bucket",
                 "elasticep_time_per_output_token_seconds_bucket"):
        assert name in queried, name


def test_the_kubernetes_example_is_valid_and_probes_health():
    import kubernetes_validate

    docs = list(yaml.safe_load_all((OPS / "kubernetes-statefulset.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Service", "StatefulSet", "StatefulSet"]
    for d in docs:
        kubernetes_validate.validate(d, "1.31", strict=True)
    leader = docs[1]["spec"]["template"]["spec"]["containers"][0]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert leader["startupProbe"]["httpGet"]["path"] == "/health"
    # a mistyped field is caught (the validator is strict)
    bad = json.loads(json.dumps(docs[1]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.31", strict=True)


def _status(epoch: int, *states: str, phase: str = "idle") -> DeploymentStatus:
    return DeploymentStatus.from_dict({
        "epoch": epoch, "ep_size": len(states), "max_ep_size": len(states),
        "scale_phase": phase, "ranks": [{"rank": r, "state": s, "pid": 1, "node": r // 2}
                                        for r, s in enumerate(states)]})


def _scenario() -> list:
    """The timeline's events of a death of rank 1, its rejoin, then its retirement."""
    tl = RecoveryTimeline()
    ev = []
    ev += tl.on_status(0.0, _status(1, "healthy", "healthy"))
    ev += tl.on_output(0.5, 1, 1, 2)
    ev += tl.on_status(1.0, _status(1, "healthy", "failed"))
    ev += tl.on_status(1.25, _status(2, "healthy", "failed"))
    ev += tl.on_output(1.5, 0, 1, 2)  # a step of the old epoch: not yet repaired
    ev += tl.on_output(1.75, 0, 2, 0)
    ev += tl.on_output(2.0, 0, 2, 3)
    ev += tl.on_status(3.0, _status(2, "healthy", "joining"))
    ev += tl.on_status(7.0, _status(2, "healthy", "ready"))
    ev += tl.on_status(7.5, _status(3, "healthy", "healthy"))
    ev += tl.on_output(8.25, 0, 3, 2)
    ev += tl.on_scale(9.0, "retire", {"operation_id": "op-1"})
    ev += tl.on_status(9.5, _status(3, "healthy", "draining", phase="draining"))
    ev += tl.on_status(10.0, _status(4, "healthy", "free"))
    return ev


def _write_log(path: Path, events: list) -> None:
    log = EventLog(path)
    for e in events:
        log.write(e)
    log.close()


def test_timeline_phases_of_a_death_a_rejoin_and_a_scale(tmp_path):
    ev = _scenario()
    phases = [(e.name, e.seconds) for e in ev if e.seconds is not None]
    assert phases == [("death_detected", 0.5), ("death_agreed", 0.25),
                      ("death_placement_repaired", 0.75), ("death_first_token", 1.0),
                      ("rejoin_loaded", 4.0), ("rejoin_admitted", 0.5),
                      ("rejoin_pause", 6.25), ("scale_done", 1.0)]
    # the metrics observe exactly what the event log writes
    m = FrontendMetrics()
    for e in ev:
        m.observe(e)
    _write_log(tmp_path / "e.jsonl", ev)
    lines = read_events(tmp_path / "e.jsonl")
    assert [ln["event"] for ln in lines] == [e.name for e in ev]
    assert [ln.get("seconds") for ln in lines] == [e.seconds for e in ev]
    text = m.render()[0].decode()
    assert 'elasticep_death_phase_seconds_sum{phase="first_token"} 1.0' in text
    assert 'elasticep_scale_seconds_sum{kind="retire"} 1.0' in text


def test_plot_events_draws_a_png(tmp_path):
    from elasticep_testkit.plot_events import main, phase_bars, state_segments

    _write_log(tmp_path / "e.jsonl", _scenario())
    lines = read_events(tmp_path / "e.jsonl")
    t0 = 0.0
    segs = state_segments(lines, t0, 11.0)
    assert segs[1] == [(1.0, 3.0, "failed"), (3.0, 7.0, "joining"), (7.0, 7.5, "ready"),
                       (7.5, 9.5, "healthy"), (9.5, 10.0, "draining"), (10.0, 11.0, "free")]
    assert phase_bars(lines, t0)[0] == ("death_detected rank 1", 0.5, 0.5)
    out = tmp_path / "timeline.png"
    assert main([str(tmp_path / "e.jsonl"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 1


@pytest.mark.parametrize(("path", "client", "keys", "needs"), [
    ("/health", "10.0.0.9", ("k", "m"), None),
    ("/v1/models", "127.0.0.1", ("k", "m"), b"k"),
    ("/metrics", "10.0.0.9", ("k", "m"), b"m"),      # its own key, not the API's
    ("/metrics", "10.0.0.9", ("k", None), b"k"),     # no metrics key: the API's
    ("/metrics", "127.0.0.1", ("k", None), b"k"),    # loopback too (a proxy is loopback)
    ("/metrics", "10.0.0.9", (None, "m"), b"m"),
    ("/v1/models", "10.0.0.9", (None, "m"), None),   # no API key: the API is open
])
def test_who_may_read_metrics(path, client, keys, needs):
    mw = ApiKeyMiddleware(None, api_key=keys[0], metrics_api_key=keys[1])
    assert mw._key_for({"type": "http", "path": path, "client": (client, 5)}) == needs


def test_the_membership_store_gauges_are_absent_without_a_store():
    """The embedded default exports no ``membership_store_ok`` sample (a 0 there would
    page an operator who never asked for etcd); a store's status sets it."""
    from elasticep.membership.status import StoreStatus

    m = FrontendMetrics()
    m.store_status(None)
    samples = [line for line in m.render()[0].decode().splitlines()
               if line.startswith("elasticep_membership_store")]
    assert samples == []  # the unlabelled gauge exported "..._ok 0.0" here
    m.store_status(StoreStatus("etcd", True, None, 7, "replica-0"))
    text = m.render()[0].decode()
    assert 'elasticep_membership_store_ok{store="etcd"} 1.0' in text
    assert 'elasticep_membership_store_revision{store="etcd"} 7.0' in text
