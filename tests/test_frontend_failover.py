"""Failover through the real HTTP server and ipc, with scripted (model-free) workers.

Two fake ranks replay fixed token scripts, so a request resumed on a survivor must
continue exactly where the client's stream stopped. Rank 0 "dies" mid-stream (its loop
stops, membership says failed), then is relaunched and takes new requests again.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from elasticep.engine.request import AbortRequest, TokenOutput
from elasticep.frontend.core import FrontendConfig
from elasticep.frontend.http_server import create_server
from elasticep.frontend_link import FrontendChannel, WorkerChannel
from elasticep.membership.status import DeploymentStatus
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)

NAME = "tiny"
STEP_S = 0.03
TEXTS = {f"prompt {i}": f" answer {i}: one two three four five six seven eight nine ten"
         for i in range(4)}


class ScriptedMembership:
    """Membership the test edits directly (the coordinator's role)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.states = {0: "healthy", 1: "healthy"}

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(
            {"epoch": self.epoch, "ep_size": 2, "max_ep_size": 2, "scale_phase": "idle",
             "ranks": [{"rank": r, "state": s, "pid": os.getpid(), "node": 0}
                       for r, s in sorted(self.states.items())]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> None:
        raise ValueError("not in this test")


class FakeRank:
    """A worker thread that emits one scripted token per request every STEP_S seconds."""

    def __init__(self, endpoints, rank: int, scripts: dict[tuple[int, ...], list[int]]):
        self.rank, self.scripts = rank, scripts
        self.served: list[str] = []
        self.bad_resume: list[str] = []
        self.emitted = 0
        self.epoch = 0  # the epoch its step outputs carry
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(endpoints,), daemon=True)
        self._thread.start()

    def _run(self, endpoints) -> None:
        channel = WorkerChannel(endpoints, self.rank)
        channel.hello()
        running: dict[str, tuple[list[int], int, int]] = {}
        while not self.stop.is_set():
            for msg in channel.poll(STEP_S):
                if isinstance(msg, AbortRequest):
                    running.pop(msg.request_id, None)
                    continue
                script = self.scripts[msg.prompt_token_ids]
                done = len(msg.output_token_ids)
                if list(msg.output_token_ids) != script[:done]:
                    self.bad_resume.append(msg.request_id)
                running[msg.request_id] = (script, done, msg.params.max_tokens)
                self.served.append(msg.request_id)
            outs = []
            for rid, (script, i, max_tokens) in list(running.items()):
                last = i + 1 >= min(max_tokens, len(script))
                outs.append(TokenOutput(rid, i, script[i], "length" if last else None))
                running[rid] = (script, i + 1, max_tokens)
                if last:
                    del running[rid]
            channel.send_outputs(outs, epoch=self.epoch)
            self.emitted += len(outs)
        channel.close()

    def kill(self) -> None:
        self.stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def cluster():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    scripts = {tuple(tok.encode(p)): tok.encode(t) for p, t in TEXTS.items()}
    channel = FrontendChannel()
    membership = ScriptedMembership()
    server, frontend = create_server(DEMO_MODEL, channel, membership, served_model_name=NAME,
                                     frontend_config=FrontendConfig(membership_poll_s=0.02))
    ranks = {r: FakeRank(channel.endpoints, r, scripts) for r in (0, 1)}
    server.start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["healthy_ranks"] < 2:
        assert time.monotonic() < deadline, "ranks never became routable"
        time.sleep(0.05)
    yield {"server": server, "client": client, "membership": membership, "ranks": ranks,
           "channel": channel, "scripts": scripts, "tok": tok, "frontend": frontend}
    server.stop()
    for r in ranks.values():
        r.kill()
    channel.close()


def stream_text(client, prompt: str) -> tuple[str, int]:
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=64,
                                            temperature=0, stream=True))
    return "".join(c.choices[0].text for c in chunks), len(chunks)


def test_killed_rank_requests_finish_on_survivor_with_exact_text(cluster):
    client, ranks, membership = cluster["client"], cluster["ranks"], cluster["membership"]
    expected = {p: cluster["tok"].decode(cluster["scripts"][tuple(cluster["tok"].encode(p))])
                for p in TEXTS}
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        futures = {p: pool.submit(stream_text, client, p) for p in TEXTS}
        deadline = time.monotonic() + 10
        while ranks[0].emitted < 6:  # rank 0 is midway through its streams
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ranks[0].kill()
        membership.epoch, membership.states[0] = 1, "failed"
        for p, fut in futures.items():
            text, n_chunks = fut.result(timeout=20)
            assert text == expected[p]
            assert n_chunks == len(cluster["tok"].encode(TEXTS[p]))
    assert ranks[1].bad_resume == [] and len(ranks[1].served) > 2  # it took rank 0's requests
    health = httpx.get(cluster["server"].url + "/health")
    assert health.status_code == 200 and health.json()["degraded"] is True
    metrics = httpx.get(cluster["server"].url + "/metrics").text
    assert "elasticep_rank_failures_total 1.0" in metrics
    assert "elasticep_resubmitted_requests_total 2.0" in metrics
    assert "elasticep_interruption_seconds_count 2.0" in metrics


def test_relaunched_rank_takes_new_requests(cluster):
    ranks, membership = cluster["ranks"], cluster["membership"]
    ranks[0] = FakeRank(cluster["channel"].endpoints, 0, cluster["scripts"])
    membership.epoch, membership.states[0] = 2, "healthy"
    deadline = time.monotonic() + 10
    while httpx.get(cluster["server"].url + "/health").json()["degraded"]:
        assert time.monotonic() < deadline, "rank 0 never became routable again"
        time.sleep(0.05)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: stream_text(cluster["client"], p), list(TEXTS)[:2]))
    assert ranks[0].served, "no request landed on the relaunched rank"
    metrics = httpx.get(cluster["server"].url + "/metrics").text
    assert "elasticep_rank_recoveries_total 1.0" in metrics
    assert "elasticep_epoch 2.0" in metrics


def _wait(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_recovery_phases_in_metrics_match_the_event_log(cluster, tmp_path):
    """A death (rank 1 stops mid-stream, then the survivors' epoch) and its rejoin
    (joining, ready, healthy): every phase lands in a histogram of /metrics with the
    duration the --event-log line gives; names and types follow Prometheus'."""
    from prometheus_client.parser import text_string_to_metric_families

    from elasticep.frontend.event_log import EventLog, read_events

    client, ranks, membership = cluster["client"], cluster["ranks"], cluster["membership"]
    url = cluster["server"].url
    frontend = cluster["frontend"]

    def scrape() -> dict:
        return {f.name: f for f in text_string_to_metric_families(
            httpx.get(url + "/metrics").text)}

    before = scrape()  # the module's earlier tests observed a death too
    frontend.event_log = EventLog(tmp_path / "events.jsonl")
    try:
        ranks[0].epoch = ranks[1].epoch = membership.epoch
        with ThreadPoolExecutor(len(TEXTS)) as pool:
            futures = [pool.submit(stream_text, client, p) for p in TEXTS]
            _wait(lambda: ranks[1].emitted >= 4, "rank 1 midway")
            ranks[1].kill()
            membership.states[1] = "failed"
            _wait(lambda: frontend.status().rank(1).state == "failed", "failure seen")
            time.sleep(0.1)
            ranks[0].epoch = membership.epoch = 3  # the survivors commit and step on
            for fut in futures:
                fut.result(timeout=20)
        membership.states[1] = "joining"
        _wait(lambda: frontend.status().rank(1).state == "joining", "joining seen")
        time.sleep(0.1)
        membership.states[1] = "ready"
        _wait(lambda: frontend.status().rank(1).state == "ready", "ready seen")
        ranks[1] = FakeRank(cluster["channel"].endpoints, 1, cluster["scripts"])
        ranks[0].epoch = ranks[1].epoch = 4
        membership.epoch, membership.states[1] = 4, "healthy"
        _wait(lambda: not httpx.get(url + "/health").json()["degraded"], "rank 1 back")
        stream_text(client, list(TEXTS)[0])
    finally:
        frontend.event_log.close()
        frontend.event_log = None
    families = scrape()
    kinds = {name: families[name].type for name in (
        "elasticep_death_phase_seconds", "elasticep_rejoin_phase_seconds",
        "elasticep_scale_seconds", "elasticep_e2e_request_latency_seconds",
        "elasticep_time_per_output_token_seconds", "elasticep_num_queue_reqs",
        "elasticep_requests_resumed", "elasticep_rank_state", "elasticep_rank_node",
        "elasticep_rank_experts_held")}
    assert kinds == {
        "elasticep_death_phase_seconds": "histogram", "elasticep_rejoin_phase_seconds":
        "histogram", "elasticep_scale_seconds": "histogram",
        "elasticep_e2e_request_latency_seconds": "histogram",
        "elasticep_time_per_output_token_seconds": "histogram",
        "elasticep_num_queue_reqs": "gauge", "elasticep_requests_resumed": "counter",
        "elasticep_rank_state": "gauge", "elasticep_rank_node": "gauge",
        "elasticep_rank_experts_held": "gauge"}

    def samples(family: str, suffix: str) -> dict[str, float]:
        """label -> value now, less the value before the scenario."""
        def read(fams: dict) -> dict[str, float]:
            return {s.labels.get("phase", s.labels.get("cause", "")): s.value
                    for s in fams[family].samples if s.name == family + suffix} \
                if family in fams else {}
        old = read(before)
        return {k: v - old.get(k, 0.0) for k, v in read(families).items()}

    events = read_events(tmp_path / "events.jsonl")
    logged: dict[str, list[float]] = {}  # rank 1's phases
    total: dict[str, float] = {}  # every phase logged (rank 0's death in the module's
    for e in events:              # first test ends its phases here: its epoch is new)
        if "seconds" in e:
            total[e["event"]] = total.get(e["event"], 0.0) + e["seconds"]
            if e.get("rank") == 1 or 1 in e.get("ranks", ()):
                logged.setdefault(e["event"], []).append(e["seconds"])
    death_sum = samples("elasticep_death_phase_seconds", "_sum")
    rejoin_sum = samples("elasticep_rejoin_phase_seconds", "_sum")
    for phase in ("detected", "agreed", "placement_repaired", "first_token"):
        assert len(logged[f"death_{phase}"]) == 1, (phase, events)
        assert death_sum[phase] == pytest.approx(total[f"death_{phase}"], abs=1e-5)
    for phase in ("loaded", "admitted", "pause"):
        assert len(logged[f"rejoin_{phase}"]) == 1, (phase, events)
        assert rejoin_sum[phase] == pytest.approx(total[f"rejoin_{phase}"], abs=1e-5)
    # the phases are ordered as they happen, and took what the script waited
    d = {p: logged[f"death_{p}"][0] for p in ("agreed", "placement_repaired", "first_token")}
    assert 0.1 <= d["agreed"] <= d["placement_repaired"] <= d["first_token"] < 5
    assert 0.1 <= logged["rejoin_loaded"][0] < 5
    states = [(e["rank"], e["state"]) for e in events if e["event"] == "rank_state"]
    assert states == [(1, "failed"), (1, "joining"), (1, "ready"), (1, "healthy")]
    assert all(isinstance(e["time"], float) for e in events)
    # its requests resumed on rank 0 (moved when its channel broke, before the snapshot)
    resumed = samples("elasticep_requests_resumed", "_total")
    assert sum(resumed.values()) >= 1 and set(resumed) <= {"failure", "unreachable"}
    assert samples("elasticep_e2e_request_latency_seconds", "_count")[""] >= 5
    node = {s.labels["rank"]: s.value for s in families["elasticep_rank_node"].samples}
    assert node == {"0": 0.0, "1": 0.0}
    state = {(s.labels["rank"], s.labels["state"]): s.value
             for s in families["elasticep_rank_state"].samples if s.value}
    assert state == {("0", "healthy"): 1.0, ("1", "healthy"): 1.0}


def test_e2e_latency_is_observed_once_per_request_not_per_choice(cluster):
    """``n`` choices and a batch of prompts are one HTTP request each: one end-to-end
    latency each (it counted every sequence), as many as finished requests."""
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> tuple[float, float]:
        fams = {f.name: f for f in text_string_to_metric_families(
            httpx.get(cluster["server"].url + "/metrics").text)}
        e2e = next(s.value for s in fams["elasticep_e2e_request_latency_seconds"].samples
                   if s.name.endswith("_count"))
        done = sum(s.value for s in fams["elasticep_requests"].samples
                   if s.name.endswith("_total") and s.labels["outcome"] == "finished")
        return e2e, done

    client, prompts = cluster["client"], list(TEXTS)
    e2e0, done0 = counts()
    out = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=8, n=2)
    assert len(out.choices) == 2
    chunks = list(client.completions.create(model=NAME, prompt=prompts[1], max_tokens=8,
                                            n=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    out = client.completions.create(model=NAME, prompt=prompts[:2], max_tokens=8)
    assert len(out.choices) == 2
    e2e, done = counts()
    assert (e2e - e2e0, done - done0) == (3, 3)
