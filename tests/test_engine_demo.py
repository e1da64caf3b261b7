"""The engine on the demo model vs transformers: greedy parity, perplexity, batching.

Near-tie rule (DESIGN.md): fp32 on the CPU is not batch-invariant, so a greedy token may
differ only where the reference's top-2 logit margin is below 1e-3; such cases are
reported (printed, visible with ``-s`` / in the -ra summary via warnings).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep_testkit.prompts import gsm8k_items

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "tiny-qwen3-moe"
NEAR_TIE = 1e-3
GREEDY32 = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(MODEL, dtype=torch.float32, progress=False)


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


def _compare(name: str, ours: list[int], ref: list[int], margins: list[float]) -> None:
    """Assert token identity up to the first near tie; report the near tie if there is one."""
    for j, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert margins[j] < NEAR_TIE, f"{name}: token {j} differs ({a} vs {b}), margin {margins[j]:.2e}"
            msg = f"{name}: near tie at token {j} (margin {margins[j]:.2e}), accepted"
            print(msg)
            warnings.warn(msg, stacklevel=2)
            return


def test_greedy_matches_transformers(engine, prompts, reference):
    outs = engine.generate(prompts, GREEDY32)
    for i, (out, (ref, margins)) in enumerate(zip(outs, reference, strict=True)):
        assert len(out) == 32
        _compare(f"prompt {i}", out, ref, margins)


def test_batched_equals_single(engine, prompts, reference):
    batched = engine.generate(prompts, GREEDY32)
    for i, p in enumerate(prompts):
        single = engine.generate([p], GREEDY32)[0]
        _compare(f"prompt {i} batched vs single", batched[i], single, reference[i][1])


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


def test_bf16_runs_close(ppl_texts, ref_ppl, prompts):
    bf16 = LLMEngine.from_pretrained(MODEL, dtype=torch.bfloat16, progress=False)
    nll = sum(_nll(bf16.prompt_logits(ids), ids) for ids in ppl_texts[:5])
    ppl = math.exp(nll / sum(len(ids) - 1 for ids in ppl_texts[:5]))
    assert math.isfinite(ppl) and ppl < 10
    outs = bf16.generate(prompts[:2], SamplingParams(max_tokens=8))
    assert all(len(o) == 8 for o in outs)


def test_prompt_longer_than_cache_or_context_is_rejected(prompts):
    from elasticep.engine.request import GenerateRequest

    small = LLMEngine.from_pretrained(MODEL, config=EngineConfig(max_total_tokens=32), progress=False)
    with pytest.raises(ValueError, match="does not fit"):
        small.add_request(GenerateRequest("long", tuple(range(40))))
    big = LLMEngine.from_pretrained(MODEL, config=EngineConfig(max_total_tokens=4096), progress=False)
    with pytest.raises(ValueError, match="context 1024"):
        big.add_request(GenerateRequest("ctx", tuple([5] * 1500)))
    assert not small.has_unfinished() and not big.has_unfinished()
