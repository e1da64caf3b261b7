"""The bundled GSM8K sample as prompts: the one place tests, benches, the chaos suite and
the demo read it.

``data/gsm8k/test_head64.jsonl`` holds the first 64 items of the GSM8K test split
(MIT licence, (c) 2021 OpenAI; github.com/openai/grade-school-math), one JSON object per
line with ``question`` and ``answer``. A missing or short file is an error, never a skip.
"""

from __future__ import annotations

import json
from pathlib import Path

from elasticep_testkit.paths import REPO

GSM8K_SAMPLE = REPO / "data" / "gsm8k" / "test_head64.jsonl"


def gsm8k_items(n: int, path: Path = GSM8K_SAMPLE) -> list[dict[str, str]]:
    """The first ``n`` items, each ``{"question": str, "answer": str}``.

    Raises:
        FileNotFoundError: ``path`` is missing.
        ValueError: it holds fewer than ``n`` items.
    """
    with open(path) as f:
        items = [json.loads(line) for line in f if line.strip()]
    if len(items) < n:
        raise ValueError(f"{path} has {len(items)} GSM8K items, {n} asked")
    return items[:n]


def gsm8k_questions(n: int, chars: int | None = None) -> list[str]:
    """The first ``n`` questions, each cut to ``chars`` characters if given (short
    prompts keep multi-process tests within a 2-core budget)."""
    return [item["question"][:chars] for item in gsm8k_items(n)]


def gsm8k_prompts(n: int) -> list[str]:
    """The first ``n`` questions as ``"Question: ...\\nAnswer:"`` prompts."""
    return [f"Question: {q}\nAnswer:" for q in gsm8k_questions(n)]
