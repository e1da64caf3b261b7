"""Poison requests (issue 30, item 1): sampling values at numeric extremes, a row whose
sampling raises, and a request whose step crashes rank after rank.

Everything here is pure or single-process; the served end-to-end case is in
test_serve_poison.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from elasticep.elastic.fault_injection import FaultInjector, FaultSpec, PoisonFault, parse_faults
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.logits_processing import process_logits
from elasticep.engine.request import (
    MIN_TEMPERATURE,
    AbortRequest,
    GenerateRequest,
    SamplingParamError,
    SamplingParams,
    TokenOutput,
)
from elasticep.engine.sampler import RowTokens, SamplingFailure, sample_batch
from elasticep.frontend.api_errors import OpenAIError
from elasticep.frontend.openai_protocol import CompletionRequest
from elasticep.frontend.request_tracker import POISON_CRASHES, RequestTracker, SendToRank
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(120)


def _logits(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 100, generator=g) * 5).to(dtype)


# Values that pass validation and used to crash the sampler or pick a wrong token: a
# float32-denormal temperature overflowed x / T to inf (softmax NaN, then top-p gathered
# index -1, or a NaN argmax chose token 0 = EOS: "" with finish_reason "stop"); a top_p
# that rounds to 0 in float32 kept no token; a top_k beyond int64 overflowed the tensor.
EXTREMES = {
    "temperature at the float32 floor": SamplingParams(temperature=MIN_TEMPERATURE),
    "temperature at the floor with top_p": SamplingParams(temperature=MIN_TEMPERATURE, top_p=0.5),
    "tiny temperature with top_k": SamplingParams(temperature=1e-30, top_k=5),
    "top_p below float32": SamplingParams(temperature=1.0, top_p=1e-46),
    "top_k beyond int64": SamplingParams(temperature=1.0, top_k=2**70),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(EXTREMES))
def test_extreme_values_sample_the_top_token(name, dtype):
    p = EXTREMES[name]
    p.validate()
    logits = _logits(dtype)
    got = sample_batch(logits, [p] * 3, ["a", "b", "c"], [0, 1, 2])
    if name == "top_k beyond int64":  # disabled top-k: a real draw, from the whole vocab
        assert got == sample_batch(logits, [SamplingParams(temperature=1.0)] * 3,
                                   ["a", "b", "c"], [0, 1, 2])
    else:  # everything but the top token is cut (or weighs exp(-huge))
        assert got == logits.float().argmax(-1).tolist()


def test_a_huge_temperature_draws_near_uniformly():
    p = SamplingParams(temperature=1e300, seed=1)
    p.validate()
    row = _logits(torch.float32)[0]
    draws = sample_batch(row.expand(2000, -1), [p] * 2000, ["u"] * 2000, list(range(2000)))
    assert len(set(draws)) > 90  # 100 tokens, 2000 draws: nearly all of them seen


@pytest.mark.parametrize("field,value", [
    ("temperature", 1e-46), ("temperature", 1e-40), ("temperature", float("inf")),
    ("temperature", float("nan")), ("top_p", 0.0), ("top_p", float("nan")),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("max_tokens", 0), ("top_k", -1)])
def test_validate_names_the_field(field, value):
    with pytest.raises(SamplingParamError, match=f"^{field} ") as info:
        SamplingParams(**{field: value}).validate()
    assert info.value.param == field


def test_int64_seed_extremes_are_accepted_and_differ():
    logits = _logits(torch.float32)
    draws = []
    for seed in (2**63 - 1, -(2**63)):
        p = SamplingParams(temperature=1.0, seed=seed)
        p.validate()
        draws.append(sample_batch(logits, [p] * 3, ["x"] * 3, [0, 1, 2]))
    assert draws[0] != draws[1]


@pytest.mark.parametrize("body,param", [
    ('{"temperature": 1e-46}', "temperature"), ('{"temperature": 1e-39}', "temperature"),
    ('{"seed": 18446744073709551616}', "seed")])
def test_the_api_answers_400_naming_the_field(body, param):
    req = CompletionRequest.model_validate({"model": "m", "prompt": "x", **json.loads(body)})
    with pytest.raises(OpenAIError) as info:
        req.to_sampling_params(8)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(f"{param} must be")


def test_a_row_whose_sampling_raises_fails_alone():
    logits = _logits(torch.float32)
    good = [SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    want = sample_batch(logits[[0, 2]], good, ["a", "c"], [3, 3])
    bad = SamplingParams(temperature="hot")  # a value no validation let through
    got = sample_batch(logits, [good[0], bad, good[1]], ["a", "b", "c"], [3, 3, 3])
    assert [got[0], got[2]] == want
    assert isinstance(got[1], SamplingFailure) and "ValueError" in got[1].message


@pytest.fixture(scope="module")
def engine():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    return LLMEngine.from_pretrained(DEMO_MODEL, progress=False, detokenize=tok.decode), tok


def test_engine_fails_the_request_and_serves_the_batch(engine):
    eng, tok = engine
    prompt = tuple(tok("Question: Ann has 4 cats and 3 dogs. How many pets?\nAnswer:").input_ids)
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    want = eng.generate([list(prompt)], p)[0]
    eng.add_request(GenerateRequest("ok", prompt, p))
    eng.add_request(GenerateRequest("bad", prompt, p))
    eng._seqs["bad"].params = SamplingParams(max_tokens=6, temperature="hot")  # past validation
    outs: list[TokenOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "abort" and bad[0].token_id is None
    assert bad[0].error.startswith("sampling failed: ValueError")
    assert [o.token_id for o in outs if o.request_id == "ok"] == want
    assert eng.request_ids() == []


def test_engine_ignores_an_empty_stop_string(engine):
    eng, tok = engine
    prompt = tok("Question: Ann has 4 cats and 3 dogs. How many pets?\nAnswer:").input_ids
    want = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True,
                                                 stop=("",)))[0] == want


# ---- poison: the front-end stops resubmitting ------------------------------------------
def _tracker():
    events = []
    tr = RequestTracker(lambda ids: "".join(chr(97 + i % 26) for i in ids))
    tr.update_ranks({0: "healthy", 1: "healthy", 2: "healthy"})
    sends = tr.add("p", (1, 2, 3), SamplingParams(max_tokens=10), events.append)
    return tr, events, sends


def test_first_crash_is_retried_second_fails_the_request():
    tr, events, sends = _tracker()
    assert sends == [SendToRank(0, GenerateRequest("p", (1, 2, 3), SamplingParams(max_tokens=10)))]
    assert tr.on_outputs(0, [TokenOutput("p", 0, 4)]) == []
    # rank 0's step raised: the report comes first, then membership shows it failed
    assert tr.on_step_failed(0, ["p"], "RuntimeError: boom") == []
    moved = tr.update_ranks({0: "failed", 1: "healthy", 2: "healthy"})
    assert moved == [SendToRank(1, GenerateRequest("p", (1, 2, 3), SamplingParams(max_tokens=10),
                                             output_token_ids=(4,)))]
    # the retry crashes rank 1 too; this time membership moves it before the report comes
    again = tr.update_ranks({0: "failed", 1: "failed", 2: "healthy"})
    assert [s.rank for s in again] == [2]
    assert POISON_CRASHES == 2
    assert tr.on_step_failed(1, ["p"], "RuntimeError: boom") == [SendToRank(2, AbortRequest("p"))]
    assert tr.num_running == 0
    last = events[-1]
    assert last.finish_reason == "abort" and not last.refused
    assert last.error == ("the request's step raised on 2 ranks [0, 1], so it is not retried "
                          "again; last error: RuntimeError: boom")
    # the poison is gone: a relaunched rank gets nothing back
    assert tr.update_ranks({0: "healthy", 1: "healthy", 2: "healthy"}) == []


def test_a_killed_rank_does_not_count_as_a_crash():
    tr, events, _ = _tracker()
    for dead in ({0}, {0, 1}):  # two kills (no step raised): resubmitted both times
        sends = tr.update_ranks({r: "failed" if r in dead else "healthy" for r in range(3)})
        assert [type(s.message) for s in sends] == [GenerateRequest]
    assert tr.num_running == 1 and events == []


def test_an_error_output_fails_the_request_with_its_message():
    tr, events, _ = _tracker()
    tr.on_outputs(0, [TokenOutput("p", 0, None, "abort", error="sampling failed: X")])
    assert events[-1].error == "sampling failed: X" and tr.num_running == 0


# ---- the test-only poison fault ------------------------------------------------------
def test_raise_spec_parses_and_fires_on_any_rank():
    assert parse_faults("raise:seed=666") == [FaultSpec(None, None, poison_seed=666)]
    for bad in ("raise:seed=x", "raise", "raise:rank=1:seed=3", "raise:step=2"):
        with pytest.raises(ValueError):
            parse_faults(bad)
    for rank in (0, 3):
        inj = FaultInjector(rank, parse_faults("raise:seed=666,kill:rank=1:step=9"))
        inj.at_batch([None, 5])
        with pytest.raises(PoisonFault, match="seed 666"):
            inj.at_batch([5, 666])


# ---- a seeded fuzz over the request schema: every body is a 400 or samples cleanly ----
_VALUES = {
    "temperature": [0, 0.0, -0.0, 1e-46, 1e-45, 1e-40, MIN_TEMPERATURE, 1e-30, 1e-5, 0.5, 1,
                    2.0, 2.0000001, -1e-9, float("nan"), float("inf"), 1e300],
    "top_p": [0.0, 1e-46, 1e-40, 1e-30, 1e-7, 0.5, 1, 1.0000001, float("nan"), -0.5],
    "top_k": [-2, -1, 0, 1, 5, 99, 100, 101, 2**31, 2**63, 2**70],
    "seed": [None, 0, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**30],
    "max_tokens": [None, 0, 1, 16, 1019, 1020, 10**9],
    "n": [None, 1, 2],
    "presence_penalty": [0.0, -0.0, 1e-300, float("nan"), 2.0, -2.5],
    "frequency_penalty": [0.0, float("inf"), 1.5],
    "repetition_penalty": [None, 0, 1, 1.3, 1e-30, float("inf")],
    "min_p": [None, 0.0, 0.2, 1.0, 1.1],
    "min_tokens": [None, 0, 2, 100],
    "stop_token_ids": [None, [], [5], [-1]],
    "logit_bias": [None, {}, {"5": 1e39}],
    "logprobs": [None, 0, 5],
    "stop": [None, "", [""], ["a", ""], "x" * 64],
    "ignore_eos": [False, True],
    "stream": [False, True],
}


def test_fuzzed_requests_are_refused_or_sample_cleanly():
    import random

    from pydantic import ValidationError

    from elasticep.frontend.api_errors import resolve_max_tokens

    rng = random.Random(30)
    logits = {dt: _logits(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    outcomes = {"refused": 0, "sampled": 0}
    for i in range(2000):
        body = {"model": "m", "prompt": "x"}
        for name in rng.sample(sorted(_VALUES), rng.randint(1, 6)):
            body[name] = rng.choice(_VALUES[name])
        try:
            req = CompletionRequest.model_validate(body)
            req.check_supported()
            params = req.to_sampling_params(resolve_max_tokens(4, req.max_tokens, 1024))
        except (ValidationError, OpenAIError) as exc:
            assert not isinstance(exc, OpenAIError) or exc.status == 400, (body, exc)
            outcomes["refused"] += 1
            continue
        dt = rng.choice(list(logits))
        rows = RowTokens([[1, 5, 7]] * 3, [[], [5], [5, 9]], {0})
        got = sample_batch(logits[dt], [params] * 3, [f"f{i}"] * 3, [0, 1, 2], rows)
        assert all(isinstance(t, int) and 0 <= t < 100 for t in got), (body, got)
        if params.temperature == 0 or params.temperature < 1e-20 or params.top_k == 1:
            processed = process_logits(logits[dt], [params] * 3, rows.prompts, rows.outputs)
            assert got == processed.argmax(-1).tolist(), body
        outcomes["sampled"] += 1
    assert outcomes["refused"] > 300 and outcomes["sampled"] > 300, outcomes
