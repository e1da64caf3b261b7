"""A prompt (or resumed output) token id outside the vocabulary is refused when the
request is added, on every path that reaches an engine (the Python ``LLM``, ``generate``
and a rank behind the HTTP front-end): it would otherwise index past the embedding
table and kill the rank, or, negative, silently read the table's last rows."""

from __future__ import annotations

import pytest
import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep_testkit.paths import DEMO_MODEL


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.float32, progress=False)


@pytest.mark.parametrize("prompt, output", [([8192], []), ([-1, 5], []), ([5, 6], [9000])])
def test_out_of_vocabulary_ids_are_refused(engine, prompt, output):
    req = GenerateRequest("r", tuple(prompt), SamplingParams(max_tokens=4),
                          output_token_ids=tuple(output))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 8192\)"):
        engine.add_request(req)
    assert not engine.has_unfinished()
    ok = engine.generate([[5, 6, 8191]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(ok[0]) == 2
