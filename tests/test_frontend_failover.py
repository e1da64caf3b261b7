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
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from elasticep.engine.request import AbortRequest, TokenOutput
from elasticep.frontend.core import FrontendConfig
from elasticep.frontend.http_server import create_server
from elasticep.frontend_link import FrontendChannel, WorkerChannel
from elasticep.membership.status import DeploymentStatus

pytestmark = pytest.mark.timeout(60)

DEMO = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"
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
            channel.send_outputs(outs)
            self.emitted += len(outs)
        channel.close()

    def kill(self) -> None:
        self.stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def cluster():
    tok = AutoTokenizer.from_pretrained(DEMO)
    scripts = {tuple(tok.encode(p)): tok.encode(t) for p, t in TEXTS.items()}
    channel = FrontendChannel()
    membership = ScriptedMembership()
    server, frontend = create_server(DEMO, channel, membership, served_model_name=NAME,
                                     frontend_config=FrontendConfig(membership_poll_s=0.02))
    ranks = {r: FakeRank(channel.endpoints, r, scripts) for r in (0, 1)}
    server.start()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["healthy_ranks"] < 2:
        assert time.monotonic() < deadline, "ranks never became routable"
        time.sleep(0.05)
    yield {"server": server, "client": client, "membership": membership, "ranks": ranks,
           "channel": channel, "scripts": scripts, "tok": tok}
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
