"""The requests of one serving benchmark run, named as in SGLang's ``bench_serving``.

- ``random``: input and output lengths drawn uniformly from
  ``[max(1, int(L * range_ratio)), L]``; the prompt is random token ids where the model
  has no tokenizer (a ``--load-format dummy`` directory with only ``config.json``) and
  text of that many tokens where it has one.
- ``gsm8k``: the bundled GSM8K sample (``data/gsm8k``) as ``Question: ...\\nAnswer:``
  prompts, cycled when more prompts are asked than it holds; every request asks for
  the drawn output length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from elasticep_testkit.prompts import gsm8k_prompts

DATASETS = ("random", "gsm8k")
GSM8K_SAMPLE_SIZE = 64  # items in data/gsm8k/test_head64.jsonl


@dataclass(frozen=True)
class BenchRequest:
    """One request of a run.

    Attributes:
        prompt: text, or token ids (a model without a tokenizer).
        prompt_len: its length in tokens (as the model's tokenizer counts it).
        output_len: ``max_tokens`` to ask for.
        prompt_ids: the token ids of ``prompt`` as the server encodes it (what the
            engine baseline feeds).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    prompt_ids: tuple[int, ...]


def draw_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float,
                 ) -> list[int]:
    """``n`` lengths uniform in ``[max(1, int(length * range_ratio)), length]``.

    Raises:
        ValueError: ``length < 1`` or ``range_ratio`` outside [0, 1].
    """
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [int(x) for x in rng.integers(low, length + 1, size=n)]


def _text_of_length(tokenizer: Any, rng: np.random.Generator, n: int,
                    usable: np.ndarray) -> tuple[str, list[int]]:
    """Text that the tokenizer encodes to exactly ``n`` tokens (random ids decoded, then
    re-encoded and cut, which a merge at the cut can shift: a few rounds fix that)."""
    ids = [int(t) for t in rng.choice(usable, size=n)]
    for _ in range(8):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == n:
            return text, again
        if len(again) > n:
            ids = again[:n]
        else:
            ids = again + [int(t) for t in rng.choice(usable, size=n - len(again))]
    # still off by a merge: keep the ids themselves, whose length is exact
    return tokenizer.decode(ids, skip_special_tokens=True), ids


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int, tokenizer: Any | None, vocab_size: int,
                    ) -> list[BenchRequest]:
    """The ``random`` dataset.

    Args:
        num_prompts: requests to make.
        input_len, output_len: the longest prompt and completion, in tokens.
        range_ratio: the shortest is ``range_ratio`` times the longest.
        seed: numpy seed; the same seed gives the same requests.
        tokenizer: a transformers tokenizer, or None for token-id prompts.
        vocab_size: ids are drawn from ``[0, vocab_size)`` (special tokens excluded
            where the tokenizer names them).

    Raises:
        ValueError: a length below 1 or a range ratio outside [0, 1].
    """
    rng = np.random.default_rng(seed)
    ins = draw_lengths(rng, num_prompts, input_len, range_ratio)
    outs = draw_lengths(rng, num_prompts, output_len, range_ratio)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    usable = np.array([t for t in range(vocab_size) if t not in special])
    out = []
    for n_in, n_out in zip(ins, outs, strict=True):
        if tokenizer is None:
            ids = tuple(int(t) for t in rng.choice(usable, size=n_in))
            out.append(BenchRequest(list(ids), n_in, n_out, ids))
        else:
            text, _ = _text_of_length(tokenizer, rng, n_in, usable)
            ids = tuple(tokenizer.encode(text))  # as the server encodes it
            out.append(BenchRequest(text, len(ids), n_out, ids))
    return out


def gsm8k_requests(num_prompts: int, output_len: int, range_ratio: float, seed: int,
                   tokenizer: Any) -> list[BenchRequest]:
    """The ``gsm8k`` dataset (text prompts; needs a tokenizer).

    Raises:
        ValueError: no tokenizer, or a bad length.
    """
    if tokenizer is None:
        raise ValueError("--dataset-name gsm8k needs a model with a tokenizer (this one "
                         "takes token ids only: use --dataset-name random)")
    rng = np.random.default_rng(seed)
    outs = draw_lengths(rng, num_prompts, output_len, range_ratio)
    texts = gsm8k_prompts(GSM8K_SAMPLE_SIZE)
    out = []
    for i, n_out in enumerate(outs):
        text = texts[i % len(texts)]
        ids = tuple(tokenizer.encode(text))
        out.append(BenchRequest(text, len(ids), n_out, ids))
    return out
