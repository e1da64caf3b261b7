"""`elasticep generate` smoke tests through a subprocess, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _ckpt_copy import linked_checkpoint

from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Question: Janet has 3 apples and buys 2 more. How many apples does she have?\nAnswer:"


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elasticep.entrypoints.cli", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=REPO)


def test_generate_prompt_and_prompts_file(tmp_path):
    from transformers import AutoTokenizer

    from elasticep.engine.llm_engine import LLMEngine
    from elasticep.engine.request import SamplingParams

    model = DEMO_MODEL  # also the default --model
    tok = AutoTokenizer.from_pretrained(model)
    expected = LLMEngine.from_pretrained(model, progress=False).generate(
        [tok(PROMPT).input_ids], SamplingParams(max_tokens=12)
    )[0]

    single = _cli("--prompt", PROMPT, "--max-tokens", "12")
    assert single.returncode == 0, single.stderr
    assert single.stdout == tok.decode(expected) + "\n"  # completion text only
    assert "loading" in single.stderr  # progress goes to stderr

    # the file's prompts computed 4 tokens a step: the first still gives the engine's
    # unchunked tokens (one process for what were two runs, chunked and batch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in [PROMPT, "ROMEO:", "Question: 1+1?\nAnswer:"]))
    batch = _cli("--prompts-file", str(prompts), "--max-tokens", "12", "--model", str(model),
                 "--chunked-prefill-size", "4")
    assert batch.returncode == 0, batch.stderr
    rows = [json.loads(line) for line in batch.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0]["token_ids"] == expected and rows[0]["text"] == tok.decode(expected)
    assert rows[0]["text"] + "\n" == single.stdout
    assert all(len(r["token_ids"]) == 12 for r in rows)

    bad = _cli("--prompt", "x" * 3000, "--max-tokens", "4", "--max-total-tokens", "64")
    assert bad.returncode == 2 and "does not fit" in bad.stderr and bad.stdout == ""


def test_eos_ids_of_generation_config_end_generation_as_in_transformers(tmp_path):
    """config.json says eos 0; generation_config.json adds a token the greedy run emits:
    transformers stops after it, and so must we (finish_reason "stop")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elasticep.engine.llm_engine import LLMEngine
    from elasticep.engine.request import SamplingParams

    src = DEMO_MODEL
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(PROMPT).input_ids
    free_run = LLMEngine.from_pretrained(src, progress=False).generate(
        [ids], SamplingParams(max_tokens=12))[0]
    stop_at = next(i for i, t in enumerate(free_run) if t not in free_run[:i] and t != 0 and i >= 2)
    model = linked_checkpoint(src, tmp_path / "tiny", "generation_config.json",
                              lambda gen: {**gen, "eos_token_id": [free_run[stop_at], 0]})

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
    assert ref.tolist() == free_run[: stop_at + 1]  # transformers stops after that token
    ours = LLMEngine.from_pretrained(model, progress=False).generate(
        [ids], SamplingParams(max_tokens=12))[0]
    assert ours == ref.tolist()
