"""A step with prefill tokens as one decode row a token (CPU: the torch reference).

On CUDA a short prefill or mixed step replays a decode graph with every token as a
row of its own (:mod:`elasticep.engine.model_runner`). That is exact only if a token
that attends to the cache up to its own position, after the step wrote every token's
K/V, sees what causal prefill gives it. Here the forward of the row form (the graph's
metadata layout, built from :func:`token_rows`) is checked against the runner's own
eager forward of the same batch, on the demo model in float32; the GPU test of the
replay itself is ``tests/test_cuda_graph_gpu.py``.
"""

from __future__ import annotations

import torch

from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.model_runner import HostLists, rows_replay_pays, token_rows
from elasticep.engine.request import SamplingParams
from elasticep.engine.scheduler import ScheduledBatch, ScheduledSeq
from elasticep.engine.sequence import Sequence
from elasticep.models.layers import AttentionMetadata
from elasticep.models.paged_attention import PagedAttentionMetadata
from elasticep_testkit.paths import DEMO_MODEL


def test_token_rows_gives_each_token_its_table_and_its_own_context():
    h = HostLists(ids=[7, 8, 9, 5, 6], positions=[4, 5, 6, 9, 0], slots=[0] * 5,
                  starts=[0, 3, 4, 5], ctx_lens=[7, 10, 1], tables=[[3, 4], [1, 2, 6], [5]])
    tables, lens = token_rows(h)
    assert tables == [[3, 4], [3, 4], [3, 4], [1, 2, 6], [5]]
    assert lens == [5, 6, 7, 10, 1]
    assert h.last_rows([True, True, False]) == [2, 3]  # each sampling sequence's last


def _row_form_logits(eng: LLMEngine, batch: ScheduledBatch) -> torch.Tensor:
    # the forward a graph replay runs: one query a row, the tables and lengths of
    # token_rows, in the layout of DecodeGraphs' metadata
    runner = eng.runner
    bs = runner.kv_cache.block_size
    h = HostLists.of(batch, bs)
    tables, lens = token_rows(h)
    sampled = h.last_rows([it.samples for it in batch.items])
    T = len(h.ids)
    paged = PagedAttentionMetadata.from_lists(tables, lens, [1] * T, bs)
    meta = AttentionMetadata(list(range(T + 1)), [1] * T,
                             torch.tensor(h.slots, dtype=torch.long), paged)
    ids, pos = torch.tensor(h.ids), torch.tensor(h.positions)
    return eng.model.forward(ids, pos, meta, runner.kv_cache.layers, torch.tensor(sampled))


def test_a_mixed_step_as_token_rows_equals_the_eager_forward():
    eng = LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.float32, device="cpu",
                                    progress=False,
                                    config=EngineConfig(max_total_tokens=512, block_size=4))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (13, 6, 9)]
    seqs = [Sequence(f"r{i}", p, [], SamplingParams(), i) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.blocks.grow(s.block_table, s.num_tokens)
    # the cached prefixes: 5 tokens of r0, all but the last of r1
    eng.runner.forward(ScheduledBatch((ScheduledSeq(seqs[0], 0, 5), ScheduledSeq(seqs[1], 0, 5))))
    # a chunk over a cached prefix (crossing blocks), a decode, a partial prompt that
    # samples nothing
    batch = ScheduledBatch((ScheduledSeq(seqs[0], 5, 13), ScheduledSeq(seqs[1], 5, 6),
                            ScheduledSeq(seqs[2], 0, 6)))
    assert [it.samples for it in batch.items] == [True, True, False]
    eager = eng.runner.forward(batch)
    rows = _row_form_logits(eng, batch)
    assert rows.shape == eager.shape == (2, eng.model.config.vocab_size)
    err = float((rows - eager).abs().max() / eager.abs().max())
    assert err < 1e-5, err
    # and the rows see the chunk causally: a wrong context length changes the logits
    h = HostLists.of(batch, 4)
    tables, lens = token_rows(h)
    sampled = h.last_rows([True, True, False])
    wrong = PagedAttentionMetadata.from_lists(tables, [n + 1 for n in lens], [1] * len(lens), 4)
    meta = AttentionMetadata(list(range(len(lens) + 1)), [1] * len(lens),
                             torch.tensor(h.slots, dtype=torch.long), wrong)
    off = eng.model.forward(torch.tensor(h.ids), torch.tensor(h.positions), meta,
                            eng.runner.kv_cache.layers, torch.tensor(sampled))
    assert float((off - eager).abs().max() / eager.abs().max()) > 1e-3


def test_a_rows_replay_is_taken_only_while_its_per_token_table_stays_small():
    short, long = [1] * 16, [1] * 525  # 256- and 8400-token contexts at block size 16
    assert rows_replay_pays(256, [short, short])
    assert rows_replay_pays(62, [long])  # 32,550 entries
    assert not rows_replay_pays(200, [long, short])  # the widest table counts
    assert rows_replay_pays(0, [])
