"""SGLang's native API (/generate, /get_server_info, /get_model_info) and the OpenAI
fields SGLang's and vLLM's benchmarks send, against the real HTTP app with a real engine
worker on the demo model; plus the stall watch and the completion chunk template."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from _frontend_live import engine_server, wait_for
from transformers import AutoTokenizer

from elasticep.engine.request import SamplingParams
from elasticep.frontend.core import FrontendConfig
from elasticep.frontend.http_server import create_server
from elasticep.frontend.membership_source import ConnectedWorkers
from elasticep.frontend.openai_responses import (
    CompletionChoice,
    CompletionResponse,
    completion_chunk_renderer,
)
from elasticep.frontend_link import FrontendChannel, WorkerChannel
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(90)

NAME = "tiny"
PROMPT = "The quick brown fox"
N = 12


@pytest.fixture(scope="module")
def live():
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = tok.encode(PROMPT)

    def reference(engine):
        return engine.generate([ids], SamplingParams(max_tokens=N, ignore_eos=True))[0]

    with engine_server(DEMO_MODEL, NAME, prepare=reference) as (server, _, _, ref):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield {"http": http, "ids": ids, "ref": ref,
                   "ref_text": tok.decode(ref, skip_special_tokens=True)}


def generate(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/generate", json=body)


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE body, [DONE] as the string."""
    out = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_answers_in_sglangs_shape_with_the_engines_tokens(live):
    sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
    r = generate(live["http"], text=PROMPT, sampling_params=sp)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"text", "meta_info"}
    assert body["text"] == live["ref_text"]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(live["ids"])
    assert meta["completion_tokens"] == N
    assert meta["finish_reason"] == {"type": "length", "length": N}
    assert meta["cached_tokens"] == 0 and meta["e2e_latency"] > 0
    assert meta["id"].startswith("gen-")
    # the same prompt as token ids, with the client's own rid
    r = generate(live["http"], input_ids=live["ids"], sampling_params=sp, rid="mine-1")
    assert r.json()["text"] == live["ref_text"]
    assert r.json()["meta_info"]["id"] == "mine-1"


def test_generate_streams_one_event_per_token_with_the_text_so_far(live):
    sp = {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}
    r = generate(live["http"], text=PROMPT, sampling_params=sp, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, N + 1))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == live["ref_text"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (N - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": N}


def test_generate_refuses_what_it_does_not_implement_naming_the_field(live):
    http = live["http"]
    cases = [
        ({"text": PROMPT, "input_ids": [1, 2]}, "text", "exactly one of text and input_ids"),
        ({}, "text", "exactly one of text and input_ids"),
        ({"text": [PROMPT, PROMPT]}, "text", "only one prompt"),
        ({"text": PROMPT, "sampling_params": {"n": 2}}, "sampling_params.n", "n=2"),
        ({"text": PROMPT, "sampling_params": {"no_stop_trim": True}},
         "sampling_params.no_stop_trim", "not supported"),
        ({"text": PROMPT, "return_routed_experts": True}, "return_routed_experts",
         "not supported"),
        # out of range: the SGLang name of the field
        ({"text": PROMPT, "sampling_params": {"frequency_penalty": 2.5}},
         "sampling_params.frequency_penalty", "must be in [-2, 2]"),
        ({"text": PROMPT, "sampling_params": {"min_new_tokens": 999}},
         "sampling_params.min_new_tokens", "min_tokens must be"),
        ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 50},
         "top_logprobs_num", "must be in [0, 20]"),
        ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 99},
         "logprob_start_len", "below the prompt"),
        ({"text": PROMPT, "sampling_params": {"stop_token_ids": [10 ** 6]}},
         "sampling_params.stop_token_ids", "token ids must be in"),
        # the field the client sent is named (before: "max_tokens", /v1's name)
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 4000}},
         "sampling_params.max_new_tokens", "maximum context length"),
        ({"input_ids": [10 ** 9]}, "input_ids", "token ids must be in"),
        ({"text": PROMPT, "bogus": 1}, "bogus", "Unrecognized request argument"),
    ]
    for body, param, message in cases:
        r = generate(http, **body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], (body, error)
    # JSON numbers no field can take (httpx's json= refuses NaN: sent as raw bytes);
    # before: NaN was "should be greater than or equal to 0" and 1e300 "Unable to parse
    # input string"
    raw = [(b'{"text": "a", "sampling_params": {"temperature": NaN}}',
            "sampling_params.temperature", "should be a finite number, got nan"),
           (b'{"text": "a", "sampling_params": {"top_p": Infinity}}',
            "sampling_params.top_p", "should be a finite number, got inf"),
           (b'{"text": "a", "sampling_params": {"max_new_tokens": 1e300}}',
            "sampling_params.max_new_tokens", "should be an integer of at most 64 bits")]
    for content, param, message in raw:
        r = http.post("/generate", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], (content, error)
        assert "string" not in error["message"] and "greater" not in error["message"]
    # the server still answers
    r = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2


def test_server_and_model_info_in_sglangs_shape(live):
    info = live["http"].get("/get_server_info").json()
    assert info["model_path"] == str(DEMO_MODEL) and info["served_model_name"] == NAME
    assert info["context_length"] == 1024  # min(context 1024, KV cache 1024)
    assert (info["ep_size"], info["tp_size"], info["dp_size"]) == (1, 1, 1)
    # one state per rank, as SGLang's one per scheduler (its clients read entry 0;
    # before: an empty list, on which older bench_serving raised IndexError)
    [state] = info["internal_states"]
    assert (state["rank"], state["state"], state["running_requests"]) == (0, "healthy", 0)
    model = live["http"].get("/get_model_info").json()
    assert model["model_path"] == str(DEMO_MODEL) and model["is_generation"] is True


def test_completions_accept_best_of_one_as_bench_serving_sends_it(live):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    r = live["http"].post("/v1/completions", json={**body, "best_of": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = live["http"].post("/v1/completions", json={**body, "best_of": 2, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_completion_chunk_template_is_byte_identical_to_pydantics_json():
    model = 'org/"odd"\\name-é'
    render = completion_chunk_renderer("cmpl-x", 1234, model)
    for text, finish in [("", None), ("a\n\"b\\c", None), ("é€😀\x00\x1f\u2028\x7f", "length"),
                         ("</s>", "stop")]:
        want = CompletionResponse(id="cmpl-x", created=1234, model=model, choices=[
            CompletionChoice(text=text, finish_reason=finish)]).model_dump_json()
        assert render(text, finish) == want


def test_a_stream_without_progress_ends_with_an_error_after_the_token_timeout():
    """The stall watch (one sweep for all streams) ends a request whose rank never
    answers after ``token_timeout_s``, within a sweep, with an error chunk."""
    channel = FrontendChannel()
    server, frontend = create_server(DEMO_MODEL, channel, ConnectedWorkers(lambda: channel.connected),
                                     served_model_name=NAME,
                                     frontend_config=FrontendConfig(token_timeout_s=0.4))
    worker = WorkerChannel(channel.endpoints, rank=0)  # says hello, never answers
    server.start()
    got = []

    def drain() -> None:  # swallow the request and the abort
        while not got:
            got.extend(worker.poll(0.1))

    answerer = threading.Thread(target=drain, daemon=True)
    try:
        worker.hello()
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 10, "routable")
        answerer.start()
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=30, json={
            "model": NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True})
        waited = time.monotonic() - t0
        events = sse_events(r)
    finally:
        server.stop()
        worker.close()
        channel.close()
    assert events[-1] == "[DONE]"
    assert events[0]["error"]["message"] == "no progress for 0.4 s"
    assert 0.4 <= waited < 2.0, waited
    assert frontend.tracker.num_running == 0
    assert got and got[0].request_id
