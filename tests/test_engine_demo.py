"""The engine on the demo model vs transformers: greedy parity, perplexity, batching.

Near-tie rule (DESIGN.md, ``elasticep_testkit.ep.assert_equal_under_near_tie_rule``): fp32 on the
CPU is not batch-invariant, so a greedy token may differ only where the reference's top-2
logit margin is below 1e-3, in at most one prompt of eight; such cases are reported.
"""

from __future__ import annotations

import math

import pytest
import torch

from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep_testkit.ep import assert_equal_under_near_tie_rule
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.prompts import gsm8k_items

pytestmark = pytest.mark.timeout(300)

GREEDY32 = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok(f"Question: {item['question']}\nAnswer:").input_ids for item in gsm8k_items(8)]


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    """transformers greedy 32 tokens per prompt, one at a time, with each step's top-2 margin."""
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf_model.generate(
                torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
            margins = [float(torch.topk(lg[0].float(), 2).values.diff().abs()) for lg in out.logits]
            refs.append((out.sequences[0, len(p):].tolist(), margins))
    return refs


def test_greedy_matches_transformers(engine, prompts, reference):
    outs = engine.generate(prompts, GREEDY32)
    assert [len(o) for o in outs] == [32] * len(prompts)
    assert_equal_under_near_tie_rule(outs, [r for r, _ in reference],
                                     [m for _, m in reference], "engine vs transformers")


def test_near_tie_rule_excuses_at_most_one_prompt_in_eight():
    ref = [[1, 2, 3]] * 16
    margins = [[0.5, 1e-4, 0.5]] * 16
    tie = [1, 9, 9]  # differs at token 1, a near tie
    with pytest.warns(UserWarning, match="near tie"):
        assert len(assert_equal_under_near_tie_rule([tie] * 2 + ref[2:], ref, margins, "t")) == 2
    with pytest.raises(AssertionError, match="3 near ties excused, at most 2"), \
            pytest.warns(UserWarning):
        assert_equal_under_near_tie_rule([tie] * 3 + ref[3:], ref, margins, "t")
    with pytest.raises(AssertionError, match="prompt 0 differs at token 0"):
        assert_equal_under_near_tie_rule([[7, 2, 3]] + ref[1:], ref, margins, "t")


def test_batched_equals_single(engine, prompts, reference):
    batched = engine.generate(prompts, GREEDY32)
    single = [engine.generate([p], GREEDY32)[0] for p in prompts]
    assert_equal_under_near_tie_rule(batched, single, [m for _, m in reference],
                                     "batched vs single")


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:])
    return float(torch.nn.functional.cross_entropy(logits[:-1].float(), target, reduction="sum"))


@pytest.fixture(scope="module")
def ppl_texts(tok):
    items = gsm8k_items(20)
    return [tok(f"<|endoftext|>Question: {x['question']}\nAnswer: {x['answer']}").input_ids for x in items]


@pytest.fixture(scope="module")
def ref_ppl(hf_model, ppl_texts):
    with torch.no_grad():
        nll = sum(_nll(hf_model(torch.tensor([ids])).logits[0], ids) for ids in ppl_texts)
    return math.exp(nll / sum(len(ids) - 1 for ids in ppl_texts))


def test_perplexity_matches_transformers(engine, ppl_texts, ref_ppl):
    nll = sum(_nll(engine.prompt_logits(ids), ids) for ids in ppl_texts)
    ours = math.exp(nll / sum(len(ids) - 1 for ids in ppl_texts))
    print(f"perplexity: ours {ours:.4f}, transformers {ref_ppl:.4f}")
    assert abs(ours - ref_ppl) / ref_ppl <= 0.005
    assert abs(ours - 7.18) < 0.05  # the README's figure


def test_bf16_runs_close(engine, ppl_texts, prompts):
    """bf16 perplexity within 1% of fp32's on the same texts (measured: -0.02%)."""
    texts = ppl_texts[:5]
    n = sum(len(ids) - 1 for ids in texts)
    fp32 = math.exp(sum(_nll(engine.prompt_logits(ids), ids) for ids in texts) / n)
    bf16 = LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.bfloat16, progress=False)
    ppl = math.exp(sum(_nll(bf16.prompt_logits(ids), ids) for ids in texts) / n)
    print(f"perplexity on {len(texts)} texts: bf16 {ppl:.4f}, fp32 {fp32:.4f}")
    assert abs(ppl - fp32) / fp32 <= 0.01, (ppl, fp32)
    outs = bf16.generate(prompts[:2], SamplingParams(max_tokens=8))
    assert [len(o) for o in outs] == [8, 8]


def test_prompt_longer_than_cache_or_context_is_rejected(prompts):
    from elasticep.engine.request import GenerateRequest

    small = LLMEngine.from_pretrained(DEMO_MODEL, config=EngineConfig(max_total_tokens=32), progress=False)
    with pytest.raises(ValueError, match="does not fit"):
        small.add_request(GenerateRequest("long", tuple(range(40))))
    big = LLMEngine.from_pretrained(DEMO_MODEL, config=EngineConfig(max_total_tokens=4096), progress=False)
    with pytest.raises(ValueError, match="context 1024"):
        big.add_request(GenerateRequest("ctx", tuple([5] * 1500)))
    assert not small.has_unfinished() and not big.has_unfinished()
