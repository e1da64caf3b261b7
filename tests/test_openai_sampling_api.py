"""The sampling parameters, logprobs, echo, ``n`` and batched prompts through the real
HTTP server (the `openai` client, and SGLang's ``/generate``) and one real engine worker
on the demo model: each against the engine run with the same params, and the logprobs
against transformers."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from _frontend_live import engine_server, make_chat_model
from transformers import AutoTokenizer

from elasticep.engine.request import SamplingParams
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(90)

NAME = "tiny"
PROMPTS = ["The quick brown fox", "Tom has 3 apples and buys 4 more. How many"]
PENALTIES = {"repetition_penalty": 1.4, "frequency_penalty": 0.7, "presence_penalty": 0.5,
             "min_tokens": 6, "logit_bias": {"13": 3.0}}
ENGINE_PENALTIES = SamplingParams(max_tokens=12, repetition_penalty=1.4, frequency_penalty=0.7,
                                  presence_penalty=0.5, min_tokens=6, logit_bias=((13, 3.0),))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model_dir = make_chat_model(tmp_path_factory.mktemp("m") / "tiny-chat")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(p) for p in PROMPTS]

    def references(engine):  # before the worker owns the engine
        return {"penalised": engine.generate(ids, ENGINE_PENALTIES),
                "greedy": engine.generate(ids, SamplingParams(max_tokens=12)),
                "seeded": [engine.generate(ids, SamplingParams(
                    max_tokens=8, temperature=1.0, seed=40 + j, ignore_eos=True))
                    for j in range(2)]}

    with engine_server(model_dir, NAME, prepare=references) as (server, _, _, refs):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                               timeout=60)
        yield {"client": client, "http": httpx.Client(base_url=server.url, timeout=60),
               "tok": tok, "ids": ids, "refs": refs}


def _text(live, ids: list[int]) -> str:
    return live["tok"].decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf_logprobs():
    """``f(ids) -> [len(ids), V]`` transformers' float32 log-softmax at every position."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return run


def test_penalties_match_the_engine_on_every_endpoint(live):
    want = [_text(live, r) for r in live["refs"]["penalised"]]
    assert want != [_text(live, r) for r in live["refs"]["greedy"]]  # they change the text
    got = [live["client"].completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0,
                                             extra_body=PENALTIES).choices[0].text
           for p in PROMPTS]
    assert got == want
    sp = {"max_new_tokens": 12, "temperature": 0, "min_new_tokens": 6,
          **{k: v for k, v in PENALTIES.items() if k != "min_tokens"}}
    r = live["http"].post("/generate", json={"text": PROMPTS[1], "sampling_params": sp})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == want[1]


def test_echo_scores_the_prompt_as_lm_eval_asks(live, hf_logprobs):
    """lm-eval-harness's loglikelihood request: echo, max_tokens 0, logprobs 1."""
    ids = live["ids"][1]
    res = live["client"].completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=0,
                                            echo=True, logprobs=1, temperature=0)
    c = res.choices[0]
    assert c.text == PROMPTS[1] and c.finish_reason == "length"
    assert res.usage.completion_tokens == 0 and res.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens == [live["tok"].decode([t]) for t in ids]
    ref = hf_logprobs(ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    # sum of the continuation's logprobs, as lm-eval scores it
    assert sum(lp.token_logprobs[1:]) == pytest.approx(sum(want), abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert all(len(d) in (1, 2) for d in lp.top_logprobs[1:])
    # streamed: one chunk with the same text and logprobs
    chunks = list(live["client"].completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1, temperature=0,
        stream=True))
    assert [(c.choices[0].text, c.choices[0].logprobs.token_logprobs) for c in chunks] == \
        [(c.text, lp.token_logprobs)]


def test_completion_logprobs_streamed_and_whole_agree_with_transformers(live, hf_logprobs):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    whole = live["client"].completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in live["client"].completions.create(**kw, stream=True)]
    streamed = [lp for c in chunks for lp in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    assert "".join(c.text for c in chunks) == whole.text
    out = live["refs"]["greedy"][0][:6]
    ref = hf_logprobs(live["ids"][0] + out)
    rows = torch.arange(len(live["ids"][0]) - 1, len(live["ids"][0]) - 1 + len(out))
    assert whole.logprobs.token_logprobs == pytest.approx(
        ref[rows, torch.tensor(out)].tolist(), abs=2e-4)
    assert all(len(d) == 3 for d in whole.logprobs.top_logprobs)  # greedy: chosen is in top 3


def test_chat_logprobs_and_top_logprobs(live):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
              temperature=0, logprobs=True, top_logprobs=2)
    whole = live["client"].chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)  # greedy
    assert content[0].bytes == list(content[0].token.encode())
    chunks = list(live["client"].chat.completions.create(**kw, stream=True))
    assert [t.logprob for c in chunks for t in c.choices[0].logprobs.content] == \
        [t.logprob for t in content]
    for body in ({**kw, "logprobs": False}, {**kw, "top_logprobs": 21}):
        bad = live["http"].post("/v1/chat/completions", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


def test_n_and_batched_prompts(live):
    """Two prompts, n=2, seeded: choice i*n+j is prompt i drawn with seed + j, streamed
    or not; a batch of token-id lists gives the greedy texts."""
    refs = live["refs"]["seeded"]
    res = live["client"].completions.create(model=NAME, prompt=PROMPTS, n=2, max_tokens=8,
                                            temperature=1.0, seed=40, extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    want = [_text(live, refs[j][i]) for i in range(2) for j in range(2)]
    assert [c.text for c in res.choices] == want
    assert res.usage.completion_tokens == 32
    assert res.usage.prompt_tokens == sum(len(i) for i in live["ids"])
    texts = ["", "", "", ""]
    for chunk in live["client"].completions.create(
            model=NAME, prompt=PROMPTS, n=2, max_tokens=8, temperature=1.0, seed=40,
            stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want
    by_ids = live["client"].completions.create(model=NAME, prompt=live["ids"], max_tokens=12,
                                               temperature=0)
    assert [c.text for c in by_ids.choices] == [_text(live, r) for r in live["refs"]["greedy"]]


def test_best_of_returns_the_most_likely_candidates(live):
    """best_of 3, n 2 is the 2 of the 3 candidates (seeds 40..42) with the highest sum of
    token logprobs, best first; without logprobs asked, none are returned."""
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=40)
    every = live["client"].completions.create(**kw, n=3, logprobs=0).choices
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = live["client"].completions.create(**kw, n=2, extra_body={"best_of": 3})
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)
    assert len({c.text for c in every}) == 3  # three different candidates
    streamed = live["http"].post("/v1/completions", json={**kw, "best_of": 3, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"


def test_concurrent_batches_do_not_mix(live):
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda _: [c.text for c in live["client"].completions.create(
            model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0).choices], range(3)))
    assert outs == [[_text(live, r) for r in live["refs"]["greedy"]]] * 3


def test_logit_bias_stop_token_ids_and_special_tokens(live):
    """A +100 bias on EOS (id 0) makes every token EOS: skipped by default, shown with
    skip_special_tokens false; stop_token_ids ends the request on it."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logit_bias": {"0": 100}}
    assert live["http"].post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    shown = live["http"].post("/v1/completions", json={**body, "skip_special_tokens": False})
    assert shown.json()["choices"][0]["text"] == "<|endoftext|>" * 3
    stopped = live["http"].post("/v1/completions", json={**body, "stop_token_ids": [0]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    # an ordinary token as a stop token: the text ends before it
    ref = live["refs"]["greedy"][0]
    stop = ref[3]
    cut = ref.index(stop)
    got = live["client"].completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12,
                                            temperature=0, extra_body={"stop_token_ids": [stop]})
    assert got.choices[0].text == _text(live, ref[:cut])
    assert got.usage.completion_tokens == cut + 1 and got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", -1),
    ("min_p", 1.5), ("min_tokens", 50), ("stop_token_ids", [99999]), ("logit_bias", {"x": 1}),
    ("logprobs", 21), ("best_of", 0), ("max_tokens", 0), ("n", 129), ("best_of", 129)])
def test_out_of_range_is_a_400_naming_the_field(live, field, value):
    r = live["http"].post("/v1/completions", json={"model": NAME, "prompt": "hi",
                                                   "max_tokens": 16, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_sglang_return_logprob(live, hf_logprobs):
    ids = live["ids"][0]
    r = live["http"].post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    out = meta["output_token_logprobs"]
    assert [t[1] for t in out] == live["refs"]["greedy"][0][:4]
    assert [len(t) for t in meta["output_top_logprobs"]] == [2] * 4
    ins = meta["input_token_logprobs"]
    assert ins[0][0] is None and [t[1] for t in ins] == ids
    ref = hf_logprobs(ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    assert [t[0] for t in ins[1:]] == pytest.approx(want, abs=2e-4)
    assert out[0][2] == live["tok"].decode([out[0][1]])
    assert not any(math.isnan(t[0]) for t in out)
