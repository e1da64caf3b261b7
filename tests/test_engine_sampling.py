"""Sampler: counter-based RNG reproducibility, resumption, filters, stop strings and EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.sampler import filter_logits, sample_token

pytestmark = pytest.mark.timeout(60)

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def engine(tok):
    return LLMEngine.from_pretrained(MODEL, progress=False, detokenize=tok.decode)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok("Question: Ann has 4 cats and 3 dogs. How many pets?\nAnswer:").input_ids


def _run(engine: LLMEngine, reqs: list[GenerateRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: list(r.output_token_ids) for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        for t in engine.step():
            assert t.index == len(out[t.request_id])  # no duplicates, no gaps
            out[t.request_id].append(t.token_id)
    return out


def test_same_seed_same_text(engine, prompt, tok):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = _run(engine, [GenerateRequest("a", tuple(prompt), p)])["a"]
    # different request id, different batch company: a user seed alone fixes the draws
    other = GenerateRequest("x", tuple(prompt[:5]), SamplingParams(max_tokens=5, temperature=1.0))
    b = _run(engine, [GenerateRequest("b", tuple(prompt), p), other])["b"]
    assert tok.decode(a) == tok.decode(b)
    c = _run(engine, [GenerateRequest("c", tuple(prompt), SamplingParams(**{**p.__dict__, "seed": 8}))])["c"]
    assert c != a


def test_resumed_request_samples_identically(engine, prompt):
    p = SamplingParams(max_tokens=16, temperature=0.9, ignore_eos=True)  # no seed: keyed on id
    full = _run(engine, [GenerateRequest("r1", tuple(prompt), p)])["r1"]
    resumed = _run(engine, [GenerateRequest("r1", tuple(prompt), p, tuple(full[:6]))])["r1"]
    assert resumed == full


def test_top_k_one_is_greedy(engine, prompt):
    greedy = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    topk1 = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True))[0]
    assert greedy == topk1


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(kept[2:]).all() and torch.isfinite(kept[:2]).all()
    # probs ~ [.64, .24, .09, .03]: top_p 0.7 keeps the first two
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()
    p = SamplingParams(temperature=1.0, seed=3)
    draws = {sample_token(logits, p, "q", i) for i in range(200)}
    assert draws == {0, 1, 2, 3}
    assert sample_token(logits, p, "q", 5) == sample_token(logits, p, "other", 5)


def test_stop_string_and_eos(engine, prompt, tok):
    greedy = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    text = tok.decode(greedy)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = _run(engine, [GenerateRequest("s", tuple(prompt), SamplingParams(max_tokens=30, stop=(stop,)))])["s"]
    assert stop in tok.decode(out) and len(out) < 30
    assert out == greedy[: len(out)]
    # make the 3rd greedy token an EOS id: generation stops right there with "stop"
    eng_eos = engine.eos_ids
    engine.eos_ids = {greedy[2]}
    try:
        engine.add_request(GenerateRequest("e", tuple(prompt), SamplingParams(max_tokens=30)))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
    finally:
        engine.eos_ids = eng_eos
    assert [o.token_id for o in outs] == greedy[:3] and outs[-1].finish_reason == "stop"
