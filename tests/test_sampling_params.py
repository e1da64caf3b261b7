"""The vLLM/SGLang sampling parameters on the sampler and the engine: each one against a
reference computed on the same logits (plain Python loops), greedy and seeded; a
request resumed from prompt + generated tokens with penalties and a seed continues
identically; logprobs (sampled and prompt) against transformers on the demo model."""

from __future__ import annotations

import math

import pytest
import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.logits_processing import process_logits
from elasticep.engine.logprobs import token_logprobs
from elasticep.engine.request import GenerateRequest, SamplingParamError, SamplingParams
from elasticep.engine.sampler import RowTokens, rng_key, sample_batch, uniform_noise
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)

V = 40
EOS = 3


def _reference(logits: list[float], p: SamplingParams, prompt: list[int],
               output: list[int]) -> list[float]:
    """vLLM's order, one token at a time: bias, min_tokens, repetition, frequency and
    presence (the definitions, written without tensors)."""
    x = list(logits)
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))}:
            x[t] = -math.inf
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


CASES = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-1.2),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=1.5, repetition_penalty=1.3),
    SamplingParams(logit_bias=((5, 100.0), (7, -3.5))),
    SamplingParams(min_tokens=8, stop_token_ids=(9, 11)),
    SamplingParams(min_tokens=8, ignore_eos=True),
    SamplingParams(min_tokens=2, stop_token_ids=(9,)),  # already past min_tokens: no mask
]


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), V, generator=g) * 3
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in CASES]
    outputs = [torch.randint(0, V, (5,), generator=g).tolist() + [4, 4] for _ in CASES]
    return logits, prompts, outputs


def test_processing_matches_the_reference_per_parameter(batch):
    logits, prompts, outputs = batch
    got = process_logits(logits, CASES, prompts, outputs, {EOS})
    for i, p in enumerate(CASES):
        want = torch.tensor(_reference(logits[i].tolist(), p, prompts[i], outputs[i]))
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6, msg=f"case {i}: {p}")
        # every case changes its row, but those with nothing to mask (EOS ignored, or
        # min_tokens already reached)
        assert torch.equal(got[i], logits[i]) == (i in (7, 8)), i


def test_greedy_and_seeded_draws_use_the_processed_logits(batch):
    logits, prompts, outputs = batch
    rows = RowTokens(prompts, outputs, {EOS})
    greedy = sample_batch(logits, CASES, ["r"] * len(CASES), [7] * len(CASES), rows)
    for i, p in enumerate(CASES):
        ref = _reference(logits[i].tolist(), p, prompts[i], outputs[i])
        assert greedy[i] == max(range(V), key=lambda t: (ref[t], -t))
    # seeded, with temperature and min_p: Gumbel-max over the reference distribution
    seeded = [SamplingParams(**{**p.__dict__, "temperature": 0.8, "min_p": 0.05, "seed": 11})
              for p in CASES]
    drawn = sample_batch(logits, seeded, ["r"] * len(CASES), [7] * len(CASES), rows)
    for i, p in enumerate(seeded):
        ref = torch.tensor(_reference(logits[i].tolist(), p, prompts[i], outputs[i]),
                           dtype=torch.float64)
        x = (ref - ref.max()) / 0.8
        x[torch.softmax(x, 0) < 0.05 * torch.softmax(x, 0).max()] = -math.inf
        u = uniform_noise(torch.tensor([rng_key("r", 11, 7)]), V)[0]
        assert drawn[i] == int(torch.argmax(x - torch.log(-torch.log(u))))


def test_min_p_keeps_what_the_definition_keeps():
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0, -4.0]])
    probs = torch.softmax(logits[0], 0)
    for min_p in (0.0, 0.1, 0.3, 0.7, 1.0):
        keep = {t for t in range(5) if probs[t] >= min_p * probs.max()}
        p = SamplingParams(temperature=1.0, min_p=min_p)
        draws = {sample_batch(logits, [p], ["m"], [i])[0] for i in range(300)}
        assert draws == keep, min_p


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 2.5), ("presence_penalty", -2.1), ("repetition_penalty", 0.0),
    ("repetition_penalty", math.inf), ("min_p", 1.5), ("min_tokens", 17),
    ("stop_token_ids", (-1,)), ("logit_bias", ((1, 101.0),)), ("logprobs", 21),
    ("prompt_logprobs", -1), ("min_p", math.nan)])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(max_tokens=16, **{field: value}).validate()
    assert info.value.param == field


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5], [0.0, 0.0, 5.0, -1.0]])
    got = token_logprobs(logits, [0, 2], [2, 0])
    ref = torch.log_softmax(logits, -1)
    assert got[0].token_id == 0 and got[0].logprob == pytest.approx(float(ref[0, 0]))
    assert [t for t, _ in got[0].top] == [1, 2]
    assert [v for _, v in got[0].top] == pytest.approx(ref[0, [1, 2]].tolist())
    assert got[1].top == () and got[1].logprob == pytest.approx(float(ref[1, 2]))


# ---- on the engine -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(DEMO_MODEL, progress=False)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok("Question: Ann has 4 cats and 3 dogs. How many pets?\nAnswer:").input_ids


def _run(engine: LLMEngine, req: GenerateRequest) -> list:
    engine.add_request(req)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


PENALISED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True,
                           repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                           min_p=0.02, logit_bias=((13, 2.0),), logprobs=2)


def test_resume_with_penalties_and_seed_continues_identically(engine, prompt):
    full = _run(engine, GenerateRequest("p1", tuple(prompt), PENALISED))
    ids = [o.token_id for o in full]
    for cut in (1, 6):  # a survivor gets prompt + the tokens the client already has
        rest = _run(engine, GenerateRequest("p2", tuple(prompt), PENALISED, tuple(ids[:cut])))
        assert [o.token_id for o in rest] == ids[cut:]
        # the same logprobs, up to prefill-vs-decode float32 rounding
        assert [o.logprobs.logprob for o in rest] == pytest.approx(
            [o.logprobs.logprob for o in full[cut:]], abs=1e-4)


def test_stop_token_ids_and_min_tokens(engine, prompt):
    free = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = free[3]
    outs = _run(engine, GenerateRequest("s1", tuple(prompt), SamplingParams(
        max_tokens=8, ignore_eos=True, stop_token_ids=(stop,))))
    first = free.index(stop)
    assert [o.token_id for o in outs] == free[:first + 1] and outs[-1].finish_reason == "stop"
    # min_tokens masks the stop token: the greedy run never draws it before that many
    outs = _run(engine, GenerateRequest("s2", tuple(prompt), SamplingParams(
        max_tokens=8, ignore_eos=True, stop_token_ids=(stop,), min_tokens=first + 3)))
    assert stop not in [o.token_id for o in outs][:first + 3]


def test_logprobs_match_transformers(engine, prompt):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    p = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = _run(engine, GenerateRequest("lp", tuple(prompt), p))
    seq = list(prompt) + [o.token_id for o in outs]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    scored = outs[0].prompt_logprobs
    assert [s.token_id for s in scored] == list(prompt[1:])
    got = torch.tensor([s.logprob for s in scored] + [o.logprobs.logprob for o in outs])
    want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    for pos, o in enumerate(outs, start=len(prompt) - 1):
        top = torch.topk(ref[pos], 3)
        assert [t for t, _ in o.logprobs.top] == top.indices.tolist()
        assert [v for _, v in o.logprobs.top] == pytest.approx(top.values.tolist(), abs=2e-4)
        assert o.logprobs.top[0][0] == o.token_id  # greedy: the top token
    assert all(len(s.top) == 2 for s in scored) and outs[1].prompt_logprobs is None


def test_prompt_logprobs_gathered_over_prefill_chunks(engine, prompt):
    """A prompt prefilled in chunks of 5 tokens scores the same tokens as one prefill."""
    from elasticep.engine.llm_engine import EngineConfig

    chunked = LLMEngine(engine.model, EngineConfig(chunked_prefill_size=5, enable_cuda_graph=False))
    p = SamplingParams(max_tokens=2, prompt_logprobs=1, logprobs=0)
    whole = _run(engine, GenerateRequest("c1", tuple(prompt), p))
    parts = _run(chunked, GenerateRequest("c1", tuple(prompt), p))
    assert [o.token_id for o in parts] == [o.token_id for o in whole]
    a, b = whole[0].prompt_logprobs, parts[0].prompt_logprobs
    assert [s.token_id for s in b] == list(prompt[1:]) == [s.token_id for s in a]
    assert [s.logprob for s in b] == pytest.approx([s.logprob for s in a], abs=1e-4)
    assert parts[1].logprobs.top == () and parts[1].prompt_logprobs is None
