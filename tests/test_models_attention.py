"""`models.layers.paged_attention`: KV writes to the cache, then attention read through
the block tables, against per-sequence SDPA over the gathered keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elasticep.models.layers import AttentionMetadata, paged_attention
from elasticep.models.paged_attention import PagedAttentionMetadata

BS = 4  # tokens per block


def _case(ctx_lens: list[int], query_lens: list[int], hq: int = 4, hkv: int = 2, d: int = 8,
          seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in ctx_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, as paged
    tables, o = [], 0
    for n in ctx_lens:
        nb = -(-n // BS)
        tables.append(perm[o:o + nb])
        o += nb
    k_cache = torch.randn(num_blocks * BS, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks * BS, hkv, d, generator=g)
    T = sum(query_lens)
    q = torch.randn(T, hq, d, generator=g)
    k = torch.randn(T, hkv, d, generator=g)
    v = torch.randn(T, hkv, d, generator=g)
    slots, starts = [], [0]
    for table, n, m in zip(tables, ctx_lens, query_lens, strict=True):
        slots += [table[p // BS] * BS + p % BS for p in range(n - m, n)]
        starts.append(starts[-1] + m)
    paged = PagedAttentionMetadata.from_lists(tables, ctx_lens, query_lens, BS)
    meta = AttentionMetadata(starts, ctx_lens, torch.tensor(slots), paged)
    return q, k, v, (k_cache, v_cache), meta


def _sdpa_per_sequence(q, cache, meta, scale, n_rep):
    k_cache, v_cache = cache
    outs = []
    for i, ctx in enumerate(meta.context_lens):
        s, e = meta.query_starts[i], meta.query_starts[i + 1]
        ks = k_cache[meta.gather_slots[i]].transpose(0, 1).repeat_interleave(n_rep, 0)
        vs = v_cache[meta.gather_slots[i]].transpose(0, 1).repeat_interleave(n_rep, 0)
        q_pos = torch.arange(ctx - (e - s), ctx)[:, None]
        mask = torch.arange(ctx)[None, :] <= q_pos
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), ks, vs, attn_mask=mask,
                                           scale=scale)
        outs.append(o.transpose(0, 1).reshape(e - s, -1))
    return torch.cat(outs)


def test_mixed_prefill_and_decode_batch_matches_per_sequence_sdpa():
    ctx, qlen = [5, 1, 17, 9, 12], [1, 1, 17, 1, 4]  # decodes, a full and a chunked prefill
    q, k, v, cache, meta = _case(ctx, qlen)
    got = paged_attention(q, k, v, cache, meta, 0.35)
    # the new tokens' K/V were written to their slots (and read back from there)
    assert torch.equal(cache[0][meta.slot_mapping], k)
    assert torch.equal(cache[1][meta.slot_mapping], v)
    want = _sdpa_per_sequence(q, cache, meta, 0.35, n_rep=2)
    assert got.shape == (sum(qlen), 4 * 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gather_slots_follow_the_block_tables():
    _, _, _, _, meta = _case([6, 3], [1, 1])
    table = meta.paged.block_tables
    assert meta.gather_slots[0].tolist() == [int(table[0, p // BS]) * BS + p % BS for p in range(6)]
    assert meta.gather_slots[1].shape == (3,)
