"""Sampler: counter-based RNG reproducibility, resumption, filters, stop strings and EOS."""

from __future__ import annotations

import pytest
import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.sampler import filter_logits, sample_batch, uniform_noise
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def engine(tok):
    return LLMEngine.from_pretrained(DEMO_MODEL, progress=False, detokenize=tok.decode)


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


def _one(logits: torch.Tensor, p: SamplingParams, rid: str, index: int) -> int:
    return sample_batch(logits[None], [p], [rid], [index])[0]


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    k = torch.tensor([p.top_k])
    return filter_logits(logits[None], torch.tensor([p.temperature]), k, torch.tensor([p.top_p]),
                         p.top_k, p.top_p < 1)[0]


def test_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    kept = _filter(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isinf(kept[2:]).all() and torch.isfinite(kept[:2]).all()
    # probs ~ [.64, .24, .09, .03]: top_p 0.7 keeps the first two
    kept = _filter(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.isfinite(kept[:2]).all() and torch.isinf(kept[2:]).all()
    # top-k first, then top-p over what is left: [.73, .27] of the top two, 0.5 keeps one
    kept = _filter(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert torch.isfinite(kept[:1]).all() and torch.isinf(kept[1:]).all()
    p = SamplingParams(temperature=1.0, seed=3)
    draws = {_one(logits, p, "q", i) for i in range(200)}
    assert draws == {0, 1, 2, 3}
    assert _one(logits, p, "q", 5) == _one(logits, p, "other", 5)


def test_splitmix_noise_known_answer():
    """The noise is splitmix64 (seed 1234567's first outputs are the published ones)."""
    u = uniform_noise(torch.tensor([1234567]), 3)[0]
    bits = [int(x * 2**52 - 0.5) for x in u.tolist()]
    assert bits == [v >> 12 for v in (6457827717110365317, 3203168211198807973, 9817491932198370423)]
    assert ((u > 0) & (u < 1)).all()


def _mixed_batch(n: int = 12, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_k=[0, 5, 0][i % 3],
                             top_p=[1.0, 0.8][i % 2], seed=(i if i % 5 else None)) for i in range(n)]
    rids = [f"r{i}" for i in range(n)]
    idx = [i * 3 for i in range(n)]
    return logits, params, rids, idx


def test_draws_do_not_depend_on_batch_company_or_order():
    logits, params, rids, idx = _mixed_batch()
    full = sample_batch(logits, params, rids, idx)
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = sample_batch(logits[order], [params[i] for i in order], [rids[i] for i in order],
                            [idx[i] for i in order])
    assert [shuffled[order.index(i)] for i in range(len(order))] == full
    for i in range(len(params)):  # each row alone
        assert _one(logits[i], params[i], rids[i], idx[i]) == full[i]
    # a different token index is a different draw (some of 12 sampled rows must change)
    moved = sample_batch(logits, params, rids, [i + 1 for i in idx])
    assert moved != full


def test_greedy_is_argmax_and_filters_hold_over_many_draws():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 40, generator=g)
    greedy = sample_batch(logits, [SamplingParams()] * 64, ["g"] * 64, list(range(64)))
    assert greedy == logits.argmax(-1).tolist()
    row = torch.randn(40, generator=g) * 2
    n = 3000
    for p in (SamplingParams(temperature=1.3, top_k=4), SamplingParams(temperature=1.0, top_p=0.6),
              SamplingParams(temperature=2.0, top_k=9, top_p=0.9)):
        allowed = torch.isfinite(_filter(row, p)).nonzero().flatten().tolist()
        got = sample_batch(row.expand(n, -1), [p] * n, [f"x{i}" for i in range(n)], [7] * n)
        assert set(got) == set(allowed)  # every kept token drawn, no filtered one ever
        assert len(allowed) < 40


def test_draws_follow_the_filtered_softmax():
    """Chi-square over 20k draws on a 6-token vocab (temperature 0.8, top_p 0.99)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -4.0])
    p = SamplingParams(temperature=0.8, top_p=0.99)
    x = _filter(logits, p)
    assert torch.isinf(x[-1])  # the tail token is cut by top-p
    want = torch.softmax(x, -1)[:-1]
    n = 20_000
    got = sample_batch(logits.expand(n, -1), [p] * n, ["d"] * n, list(range(n)))
    counts = torch.bincount(torch.tensor(got), minlength=6).double()
    assert counts[-1] == 0
    chi2 = float((((counts[:-1] - n * want) ** 2) / (n * want)).sum())
    assert chi2 < 18.5  # 4 degrees of freedom: p ~ 0.001


def test_sample_batch_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="2 logit rows but 1 params"):
        sample_batch(torch.zeros(2, 5), [SamplingParams()], ["a", "b"], [0, 0])


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
