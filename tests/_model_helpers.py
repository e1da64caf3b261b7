"""Shared pieces of the forward-pass tests against transformers (not a test module)."""

from __future__ import annotations

import torch

from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.model_runner import ModelRunner
from elasticep.engine.request import SamplingParams
from elasticep.engine.scheduler import ScheduledBatch, ScheduledSeq
from elasticep.engine.sequence import Sequence


def run_batched(model, prompts: list[list[int]], split: int, num_blocks: int = 64) -> list[torch.Tensor]:
    """Prefill all but the last ``split`` tokens of every prompt in one batch, then the
    rest in a second batch over the paged cache (block size 4); return logits
    ``[len(prompt), V]`` per prompt. ``split`` 1 makes the second batch a decode step."""
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=4)
    blocks = BlockManager(num_blocks, 4)
    seqs = [Sequence(f"r{i}", p, [], SamplingParams(), i) for i, p in enumerate(prompts)]
    for s in seqs:
        blocks.grow(s.block_table, s.num_tokens)
    first = runner.forward(ScheduledBatch(tuple(ScheduledSeq(s, 0, s.num_tokens - split) for s in seqs)), True)
    second = runner.forward(
        ScheduledBatch(tuple(ScheduledSeq(s, s.num_tokens - split, s.num_tokens) for s in seqs)), True
    )
    out, a, b = [], 0, 0
    for p in prompts:
        n1 = len(p) - split
        out.append(torch.cat([first[a : a + n1], second[b : b + split]]))
        a, b = a + n1, b + split
    return out


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


def engine_prefill_logits(eng, lengths: list[int], max_token: int) -> torch.Tensor:
    """``[sum(lengths), V]`` float32 logits (on CPU) of one prefill step of ``eng`` (an
    ``LLMEngine``) over random whole prompts of ``lengths`` tokens, ids in
    ``[10, max_token)`` drawn with a seed fixed by the lengths."""
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [Sequence(f"p{i}", torch.randint(10, max_token, (n,), generator=gen).tolist(), [],
                     SamplingParams(), -1) for i, n in enumerate(lengths)]
    for s in seqs:
        eng.blocks.grow(s.block_table, s.num_tokens)
    batch = ScheduledBatch(tuple(ScheduledSeq(s, 0, s.num_tokens) for s in seqs))
    return eng.runner.forward(batch, all_logits=True).float().cpu()
