"""End-to-end: the real `openai` client against the real HTTP server and a real engine
worker (ep_size=1, in-process thread) on the demo model; plus a worker-less server for
the paths that need no tokens (no chat template, no healthy rank, scale errors)."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from _ckpt_copy import linked_checkpoint
from _frontend_live import engine_server, make_chat_model, wait_for
from transformers import AutoTokenizer

from elasticep.engine.request import SamplingParams
from elasticep.frontend.http_server import create_server
from elasticep.frontend.incremental_text import IncrementalText
from elasticep.frontend.membership_source import ScaleInProgressError
from elasticep.frontend_link import FrontendChannel, WorkerChannel
from elasticep.membership.status import DeploymentStatus
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(90)

API_KEY = "sk-test-elasticep"
NAME = "tiny"
MAX_TOKENS = 10
PROMPTS = ["The quick brown fox", "Tom has 3 apples and buys 4 more. How many"]
CHAT = [{"role": "user", "content": "How many legs does a cat have?"}]


def demo_with(dst: Path, name: str, **changes) -> Path:
    """The demo model in ``dst`` (files symlinked) with the JSON file ``name`` updated
    by ``changes``."""
    return linked_checkpoint(DEMO_MODEL, dst, name, lambda data: {**data, **changes})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """Server with a chat-template model, an api key and one engine worker thread."""
    model_dir = make_chat_model(tmp_path_factory.mktemp("m") / "tiny-chat")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    chat_text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    prompts.append(tokenizer.encode(chat_text, add_special_tokens=False))

    def references(engine):  # before the worker owns the engine
        return engine.generate(prompts, [greedy] * len(prompts))

    with engine_server(model_dir, NAME, api_key=API_KEY, prepare=references) as (
            server, frontend, engine, refs):
        ref_texts = [tokenizer.decode(r, skip_special_tokens=True) for r in refs]
        http = httpx.Client(base_url=server.url,
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                               timeout=60)
        yield {"server": server, "frontend": frontend, "http": http, "client": client,
               "refs": refs, "ref_texts": ref_texts, "engine": engine}


def test_greedy_completion_equals_engine_output(live):
    assert all(len(t) > 5 for t in live["ref_texts"])  # a real comparison, not "" == ""
    for i, prompt in enumerate(PROMPTS):
        res = live["client"].completions.create(model=NAME, prompt=prompt,
                                                max_tokens=MAX_TOKENS, temperature=0)
        assert res.choices[0].text == live["ref_texts"][i]
        assert res.usage.completion_tokens == len(live["refs"][i])
        assert res.choices[0].finish_reason in ("length", "stop")


def test_streaming_sends_one_chunk_per_token(live):
    stream = live["client"].completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == len(live["refs"][0]) == chunks[-1].usage.completion_tokens
    assert "".join(c.choices[0].text for c in token_chunks) == live["ref_texts"][0]
    assert token_chunks[-1].choices[0].finish_reason is not None


def test_chat_completion_with_template(live):
    res = live["client"].chat.completions.create(model=NAME, messages=CHAT,
                                                 max_tokens=MAX_TOKENS, temperature=0)
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == live["ref_texts"][-1]
    chunks = list(live["client"].chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert len(chunks) == len(live["refs"][-1])
    assert "".join(c.choices[0].delta.content for c in chunks) == live["ref_texts"][-1]


def test_stop_string_cuts_text(live):
    ref = live["ref_texts"][1]
    stop = ref[len(ref) // 2:len(ref) // 2 + 2]
    res = live["client"].completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                            temperature=0, stop=[stop])
    assert res.choices[0].text == ref[:ref.index(stop)]
    assert res.choices[0].finish_reason == "stop"


def test_concurrent_streams(live):
    """Three streams batched together: each gets its own prompt's greedy text, one chunk
    per token (a batching mix-up or a lost chunk changes the text)."""
    def run(prompt: str) -> tuple[str, int, int]:
        chunks = list(live["client"].completions.create(
            model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        token_chunks = [c for c in chunks if c.choices]
        return ("".join(c.choices[0].text for c in token_chunks), len(token_chunks),
                chunks[-1].usage.completion_tokens)

    order = [0, 1, 0]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(run, [PROMPTS[i] for i in order]))
    assert [g[0] for g in got] == [live["ref_texts"][i] for i in order]
    assert [g[1:] for g in got] == [(len(live["refs"][i]),) * 2 for i in order]


def test_client_disconnect_aborts_request(live):
    http = live["http"]
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        got: list[str] = []
        for line in resp.iter_lines():
            if line.startswith("data:"):
                got.append(line)
            if len(got) == 2:
                break
    wait_for(lambda: http.get("/health").json()["running_requests"] == 0, 10,
             "the aborted request to leave the tracker")
    wait_for(lambda: not live["engine"].has_unfinished(), 10, "the worker to drop it")
    res = live["client"].completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2)
    assert res.usage.completion_tokens >= 1


def test_non_streaming_client_disconnect_aborts_request(live):
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        live["http"].post("/v1/completions", json=body, timeout=0.5)
    wait_for(lambda: live["http"].get("/health").json()["running_requests"] == 0, 10,
             "the abandoned request to be aborted")
    wait_for(lambda: not live["engine"].has_unfinished(), 10, "the worker to drop it")


def test_incremental_detokenization_matches_full_decode():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for text in ["héllo wörld, naïve café", "数学 题目 🙂 ok", "a\n\n  b\tc ---> 3.14"]:
        ids = tok.encode(text)
        inc = IncrementalText(lambda t: tok.decode(t, skip_special_tokens=True))
        streamed = "".join(inc.push(i) for i in ids) + inc.finish()
        assert streamed == tok.decode(ids, skip_special_tokens=True)


BAD_BODIES = [
    ('{"model": "tiny", "prompt": "hi"', "Invalid JSON"),
    ({"model": NAME, "prompt": "hi", "bogus": 1}, "bogus"),
    ({"model": NAME, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"model": NAME, "prompt": "hi", "temperature": 7}, "temperature"),
    ({"model": NAME, "prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ({"model": NAME, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": NAME, "prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, "echo"),
    ({"model": NAME, "prompt": "hi " * 1100}, "context length"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 5000}, "context length"),
    ({"model": NAME, "prompt": [1, 2, 99999]}, "token ids"),
    ({"model": NAME, "prompt": ""}, "empty"),
    ([1, 2, 3], None),
]


def test_bad_requests_get_openai_errors_and_server_keeps_serving(live):
    http = live["http"]
    for body, needle in BAD_BODIES:
        kw = {"content": body, "headers": {"Content-Type": "application/json"}} \
            if isinstance(body, str) else {"json": body}
        resp = http.post("/v1/completions", **kw)
        assert resp.status_code == 400, (body, resp.text)
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if needle:
            assert needle in err["message"], err
    resp = http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = http.post("/v1/chat/completions", json={"model": NAME, "messages": []})
    assert resp.status_code == 400
    assert http.get("/nowhere").status_code == 404
    res = live["client"].completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2)
    assert res.usage.completion_tokens >= 1
    metrics = http.get("/metrics").text
    assert 'elasticep_requests_total{endpoint="completions",outcome="rejected"}' in metrics


def test_null_sampling_fields_mean_unset_as_in_openai(live):
    """Clients that serialise every field send null for the ones they leave unset."""
    http = live["http"]
    base = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    want = http.post("/v1/completions", json=base)
    got = http.post("/v1/completions", json={**base, "top_p": None, "top_k": None, "n": None,
                                             "stream": None, "presence_penalty": None})
    assert want.status_code == 200 and got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    assert http.post("/v1/completions", json={**base, "model": None}).status_code == 400


def test_api_key_is_required_everywhere_but_health(live):
    url = live["server"].url
    assert httpx.get(url + "/health").status_code in (200, 503)  # probes need no key
    assert httpx.head(url + "/health").status_code in (200, 503)
    lower = httpx.get(url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    assert lower.status_code == 200  # the auth scheme is case-insensitive
    for path in ("/v1/models", "/metrics", "/elastic_ep_status"):
        assert httpx.get(url + path).status_code == 401
        bad = httpx.get(url + path, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and "error" in bad.json()
    bad_client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert [m.id for m in live["client"].models.list()] == [NAME]


def test_metrics_status_and_scale_endpoints(live):
    http = live["http"]
    # a finished request of its own, so the labelled counters have a sample even when
    # this test runs alone
    live["client"].completions.create(model=NAME, prompt="Hello", max_tokens=2)
    text = http.get("/metrics").text
    for name in ("elasticep_requests_total", "elasticep_generation_tokens_total",
                 "elasticep_prompt_tokens_total", "elasticep_epoch", "elasticep_active_ranks",
                 "elasticep_rank_failures_total", "elasticep_rank_recoveries_total",
                 "elasticep_interruption_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert "elasticep_active_ranks 1.0" in text
    status = http.get("/elastic_ep_status").json()
    assert set(status) == {"epoch", "ep_size", "max_ep_size", "scale_phase", "ranks"}
    assert status["ranks"] == [{"rank": 0, "state": "healthy", "pid": status["ranks"][0]["pid"],
                                "node": 0, "running_requests": 0}]
    health = http.get("/health").json()
    assert health["degraded"] is False and health["status"] == "ok"
    assert http.post("/scale_elastic_ep", json={"new_ep_size": 4}).status_code == 400
    assert http.post("/scale_elastic_ep", json={"new_ep_size": 1}).status_code == 400
    assert http.post("/scale_elastic_ep", json={"size": 1}).status_code == 400


class FakeMembership:
    """A deployment where every rank is down and a scale-up is underway."""

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(
            {"epoch": 3, "ep_size": 2, "max_ep_size": 4, "scale_phase": "admitting",
             "ranks": [{"rank": 0, "state": "failed", "pid": None, "node": 0},
                       {"rank": 1, "state": "joining", "pid": 1234, "node": 0}]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        raise ScaleInProgressError("already scaling to 4")


def test_workerless_server_answers_chat_400_health_503_scale_409():
    channel = FrontendChannel()
    server, _ = create_server(DEMO_MODEL, channel, FakeMembership(), served_model_name=NAME)
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2)
        with pytest.raises(openai.InternalServerError):  # 503: nothing can serve
            client.completions.create(model=NAME, prompt="hi", max_tokens=2)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["degraded"] is True
        status = httpx.get(server.url + "/elastic_ep_status").json()
        assert status["epoch"] == 3 and status["ranks"][1]["running_requests"] == 0
        scale = httpx.post(server.url + "/scale_elastic_ep", json={"new_ep_size": 3})
        assert scale.status_code == 409 and "already scaling" in scale.json()["error"]["message"]
        assert httpx.post(server.url + "/scale_elastic_ep",
                          json={"new_ep_size": 5}).status_code == 400
        assert "elasticep_rank_failures_total 1.0" in httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
        channel.close()


class RecordingMembership:
    """Four healthy ranks, capacity four; records every scale the front-end asks for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(
            {"epoch": 1, "ep_size": 4, "max_ep_size": 4, "scale_phase": "idle",
             "ranks": [{"rank": r, "state": "healthy", "pid": 100 + r, "node": 0}
                       for r in range(4)]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        self.asked.append(new_ep_size)
        return {}


@pytest.fixture
def recording_server():
    channel = FrontendChannel()
    membership = RecordingMembership()
    server, _ = create_server(DEMO_MODEL, channel, membership, served_model_name=NAME)
    server.start()
    try:
        yield server.url, membership
    finally:
        server.stop()
        channel.close()


def test_scale_request_is_strict_and_names_the_problem(recording_server):
    url, membership = recording_server

    def refused(body: dict) -> str:
        r = httpx.post(url + "/scale_elastic_ep", json=body)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "new_ep_size" in refused({"new_ep_size": "3"})  # a string is not a size
    assert "new_ep_size" in refused({"new_ep_size": True})
    assert refused({"ep_size": 3}) == "Unrecognized request argument supplied: ep_size"
    assert refused({}) == ("give exactly one of new_ep_size, retire_ranks and drain_node "
                           "(got none)")
    assert refused({"new_ep_size": 3, "drain_node": 1}) == (
        "give exactly one of new_ep_size, retire_ranks and drain_node (got ['new_ep_size', "
        "'drain_node'])")
    assert "retire_ranks" in refused({"retire_ranks": []})
    assert "retire_ranks" in refused({"retire_ranks": ["1"]})
    assert refused({"new_ep_size": 6}) == ("new_ep_size must be in [1, 4] (serve "
                                           "--max-ep-size 4 caps growth), got 6")
    assert membership.asked == []
    ok = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 3})
    assert ok.status_code == 200 and ok.json()["new_ep_size"] == 3
    assert membership.asked == [3]


def test_models_retrieve_answers_the_served_model_and_404_for_others(recording_server):
    url, _ = recording_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(NAME)
    assert (card.id, card.object, card.owned_by) == (NAME, "model", "elasticep")
    assert card.model_dump()["max_model_len"] == client.models.list().data[0].max_model_len
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")


class ScriptedMembership:
    """Four slots whose states the test sets; every pid is this process (the hellos')."""

    def __init__(self) -> None:
        self.states = ["healthy", "joining", "joining", "joining"]

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict(
            {"epoch": 1, "ep_size": 4, "max_ep_size": 4, "scale_phase": "idle",
             "ranks": [{"rank": r, "state": s, "pid": os.getpid(), "node": 0}
                       for r, s in enumerate(self.states)]})

    def scale(self, new_ep_size: int, operation_id: str | None = None) -> dict:
        raise ScaleInProgressError("not in this test")


def test_health_is_503_until_every_rank_is_ready_then_degraded_semantics():
    channel = FrontendChannel()
    membership = ScriptedMembership()
    server, _ = create_server(DEMO_MODEL, channel, membership, served_model_name=NAME)
    workers = [WorkerChannel(channel.endpoints, rank=r) for r in range(4)]
    server.start()
    try:
        workers[0].hello()
        wait_for(lambda: httpx.get(server.url + "/health").json()["healthy_ranks"] == 1, 10,
                 "rank 0 healthy")
        health = httpx.get(server.url + "/health")  # three of four still load
        assert health.status_code == 503
        assert health.json()["status"] == "starting"
        assert health.json()["reason"] == "starting: 1 of 4 ranks ready"
        membership.states = ["healthy"] * 4
        for w in workers[1:]:
            w.hello()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 10, "ready")
        assert httpx.get(server.url + "/health").json()["degraded"] is False
        membership.states[2] = "failed"  # after start-up: 200, degraded
        wait_for(lambda: httpx.get(server.url + "/health").json()["degraded"], 10, "degraded")
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        server.stop()
        for w in workers:
            w.close()
        channel.close()


class OneRank(ScriptedMembership):
    """One slot, healthy."""

    def __init__(self) -> None:
        self.states = ["healthy"]

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict({**super().status().to_dict(), "ep_size": 1,
                                           "max_ep_size": 1})


def test_api_limit_is_the_engine_limit_and_engine_refusals_are_400(tmp_path):
    from elasticep.engine.llm_engine import max_sequence_len
    from elasticep.models.config import load_model_config

    # a sliding window of 64 tokens: the engine caps sequences there (full attention
    # past it would differ), so the API must advertise and check 64, not the context
    model = demo_with(tmp_path / "windowed", "config.json",
                      use_sliding_window=True, sliding_window=64)
    assert max_sequence_len(load_model_config(model), None) == 64
    channel = FrontendChannel()
    server, _ = create_server(model, channel, OneRank(), served_model_name=NAME)
    worker = WorkerChannel(channel.endpoints, rank=0)
    server.start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert client.models.list().data[0].max_model_len == 64
        worker.hello()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 10, "routable")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=NAME, prompt=list(range(1, 41)), max_tokens=30)
        assert err.value.code == "context_length_exceeded"

        # whatever the engine still refuses comes back as a 400 with its reason
        def refuse() -> None:
            msgs = []
            while not msgs:
                msgs = worker.poll(0.1)
            worker.send_error(msgs[0].request_id, "top_k must be < vocab")
        refuser = threading.Thread(target=refuse, daemon=True)
        refuser.start()
        with pytest.raises(openai.BadRequestError, match="top_k must be < vocab"):
            client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2)
        refuser.join(10)
    finally:
        server.stop()
        worker.close()
        channel.close()


class HalfFree(ScriptedMembership):
    """serve --ep-size 2 --max-ep-size 4: slots 2 and 3 were never started."""

    def __init__(self) -> None:
        self.states = ["healthy", "healthy", "free", "free"]

    def status(self) -> DeploymentStatus:
        return DeploymentStatus.from_dict({**super().status().to_dict(), "ep_size": 2})


def test_unused_capacity_is_free_in_status_and_metrics():
    channel = FrontendChannel()
    server, _ = create_server(DEMO_MODEL, channel, HalfFree(), served_model_name=NAME)
    server.start()
    try:
        status = httpx.get(server.url + "/elastic_ep_status").json()
        assert [r["state"] for r in status["ranks"]] == ["healthy", "healthy", "free", "free"]
        metrics = httpx.get(server.url + "/metrics").text
        assert 'elasticep_slots{state="free"} 2.0' in metrics
        assert 'elasticep_slots{state="healthy"} 2.0' in metrics
        assert 'elasticep_slots{state="removed"}' not in metrics
    finally:
        server.stop()
        channel.close()


def test_generation_config_sampling_defaults_fill_what_the_request_leaves_unset(tmp_path):
    """temperature/top_p/top_k that generation_config.json sets (read back through
    transformers' GenerationConfig) are the defaults of a request that does not send
    them; a value the request sends wins; a bad value is a one-line error at start."""
    from transformers import GenerationConfig

    from elasticep.engine.request import TokenOutput
    from elasticep.models.config import load_model_config

    sampled = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    model = demo_with(tmp_path / "sampled", "generation_config.json", **sampled)
    hf = GenerationConfig.from_pretrained(model)
    channel = FrontendChannel()
    server, _ = create_server(model, channel, OneRank(), served_model_name=NAME)
    worker = WorkerChannel(channel.endpoints, rank=0)
    received = []

    def answer() -> None:  # one token per request, then "stop"
        while len(received) < 3:
            for msg in worker.poll(0.1):
                received.append(msg.params)
                worker.send_outputs([TokenOutput(msg.request_id, 0, 5, "stop")])

    answerer = threading.Thread(target=answer, daemon=True)
    server.start()
    try:
        worker.hello()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 10, "routable")
        answerer.start()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2)
        client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2, temperature=0)
        client.completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=2, top_p=0.5,
                                  extra_body={"top_k": -1})
        answerer.join(10)
    finally:
        server.stop()
        worker.close()
        channel.close()
    assert [(p.temperature, p.top_p, p.top_k) for p in received] == [
        (hf.temperature, hf.top_p, hf.top_k),  # 0.6, 0.95, 20: all from the model
        (0.0, hf.top_p, hf.top_k),             # the request's temperature wins
        (hf.temperature, 0.5, 0),              # its top_p, and top_k -1 disables
    ]
    assert (hf.temperature, hf.top_p, hf.top_k) == (0.6, 0.95, 20)

    # the demo model's file sets none of them: OpenAI's defaults
    demo = load_model_config(DEMO_MODEL).sampling_defaults
    assert (demo.temperature, demo.top_p, demo.top_k) == (None, None, None)
    bad = demo_with(tmp_path / "bad", "generation_config.json", **{**sampled, "top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be a number "
                                         r"in \(0, 1\], got 1.5$"):
        load_model_config(bad)


GATED = "a prompt whose tokenization takes as long as the test wants"


class GatedTokenizer:
    """The demo tokenizer, except that encoding GATED waits until the test says go (a
    long prompt's tokenization, without the seconds)."""

    def __init__(self) -> None:
        self.tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str, **kw) -> list[int]:
        if text == GATED:
            self.entered.set()
            self.go.wait(30)
        return self.tok.encode(text, **kw)


def test_a_long_tokenization_leaves_the_server_answering_the_others():
    """A 20 MB prompt used to be tokenized on the event loop: 10 s in which no stream got
    a token and /health did not answer. The tokenizer now runs on its own thread."""
    from elasticep.frontend.core import Frontend
    from elasticep.frontend.http_server import HttpServer, ServerConfig, build_app

    channel = FrontendChannel()
    tok = GatedTokenizer()
    frontend = Frontend(channel, RecordingMembership(), tok.decode)
    server = HttpServer(build_app(frontend, tok, ServerConfig(model_name=NAME,
                                                              max_model_len=1024)))
    server.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, server.url + "/v1/completions", timeout=30,
                               json={"model": NAME, "prompt": GATED, "max_tokens": 2})
            assert tok.entered.wait(20)
            # that request is inside the tokenizer: the others are still answered
            assert httpx.get(server.url + "/v1/models", timeout=5).json()["data"][0]["id"] == NAME
            bad = httpx.post(server.url + "/v1/completions", timeout=5,
                             json={"model": NAME, "prompt": "hi", "n": 3, "best_of": 2})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"
            tok.go.set()
            # then it goes on as before: tokenized, checked, and (no rank is connected) 503
            assert slow.result(30).status_code == 503
    finally:
        tok.go.set()
        server.stop()
        channel.close()


def test_rejections_are_counted_per_route_not_per_requested_model_id(recording_server):
    """GET /v1/models/<anything> used to add one metric series per id asked for."""
    url, _ = recording_server
    for i in range(3):
        assert httpx.get(f"{url}/v1/models/nope-{i}").status_code == 404
    metrics = httpx.get(url + "/metrics").text
    assert "nope-" not in metrics
    assert ('elasticep_requests_total{endpoint="/v1/models/{model_id:path}",outcome="rejected"} '
            '3.0') in metrics


def test_a_body_that_is_not_a_json_object_gets_a_message_that_says_so(recording_server):
    """`curl -d '{...}'` without a JSON Content-Type used to get pydantic's "Input should
    be a valid dictionary or object to extract fields from"."""
    url, _ = recording_server
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2})
    form = httpx.post(url + "/v1/completions", content=body,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 400
    assert form.json()["error"]["message"] == (
        "The request body must be a JSON object (it came as Content-Type "
        "'application/x-www-form-urlencoded': send 'Content-Type: application/json')")
    array = httpx.post(url + "/v1/completions", json=[1, 2])
    assert array.status_code == 400
    assert array.json()["error"]["message"] == "The request body must be a JSON object"
    scale = httpx.post(url + "/scale_elastic_ep", content='{"new_ep_size": 3}')
    assert scale.status_code == 400 and "Content-Type 'none'" in scale.json()["error"]["message"]


def test_a_lone_surrogate_in_a_prompt_is_a_400_not_a_500(recording_server):
    """JSON's "\\ud800" escape decodes to a lone surrogate, which the tokenizer refused
    with a TypeError: a 500 "internal error" and a traceback in the server log."""
    url, _ = recording_server
    body = json.dumps({"model": NAME, "prompt": "ab\ud800 c", "max_tokens": 2})
    assert "\\ud800" in body  # json escapes it: what a client sends
    resp = httpx.post(url + "/v1/completions", headers={"Content-Type": "application/json"},
                      content=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": "prompt is not valid Unicode: surrogates not allowed at character 2",
        "type": "invalid_request_error", "param": "prompt", "code": None}
    # in a batch, the error names the prompt that has it
    batch = json.dumps({"model": NAME, "prompt": ["fine", "ab\ud800 c"], "max_tokens": 2})
    resp = httpx.post(url + "/v1/completions", headers={"Content-Type": "application/json"},
                      content=batch)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == (
        "prompt.1 is not valid Unicode: surrogates not allowed at character 2")


def test_a_lone_surrogate_in_a_chat_message_is_a_400(live):
    body = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "ok"},
                                                   {"role": "user", "content": "\udfff"}]})
    resp = live["http"].post("/v1/chat/completions", content=body,
                             headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == ("messages.1.content is not valid Unicode: "
                                               "surrogates not allowed at character 0")


def test_a_request_too_long_for_the_context_names_the_field_it_came_in():
    from elasticep.frontend.api_errors import OpenAIError, resolve_max_tokens
    from elasticep.frontend.openai_protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    for body, param in (({"max_completion_tokens": 60}, "max_completion_tokens"),
                        ({"max_tokens": 60}, "max_tokens"),
                        ({"max_tokens": 8, "max_completion_tokens": 60},
                         "max_completion_tokens")):
        req = ChatCompletionRequest(model=NAME, messages=messages, **body)
        assert req.max_tokens_param() == param
        with pytest.raises(OpenAIError) as err:
            resolve_max_tokens(10, req.requested_max_tokens(), 64, req.max_tokens_param())
        assert err.value.param == param and err.value.code == "context_length_exceeded"
    assert resolve_max_tokens(10, 54, 64, "max_completion_tokens") == 54
