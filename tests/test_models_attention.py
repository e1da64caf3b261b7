"""The batched decode path of `paged_attention` against the per-sequence path."""

from __future__ import annotations

import torch

from elasticep.models.layers import AttentionMetadata, paged_attention


def _decode_case(ctx_lens: list[int], hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(ctx_lens) + 5
    k_cache = torch.randn(num_slots, hkv, d, generator=g)
    v_cache = torch.randn(num_slots, hkv, d, generator=g)
    perm = torch.randperm(num_slots, generator=g)  # scattered slots, like a paged cache
    gather, o = [], 0
    for n in ctx_lens:
        gather.append(perm[o:o + n])
        o += n
    B = len(ctx_lens)
    q = torch.randn(B, hq, d, generator=g)
    k = torch.randn(B, hkv, d, generator=g)
    v = torch.randn(B, hkv, d, generator=g)
    meta = AttentionMetadata(query_starts=list(range(B + 1)), context_lens=ctx_lens,
                             slot_mapping=torch.stack([s[-1] for s in gather]),
                             gather_slots=gather)
    return q, k, v, (k_cache, v_cache), meta


def test_batched_decode_equals_per_sequence_loop():
    q, k, v, cache, meta = _decode_case([5, 1, 17, 9])
    written = (cache[0].clone(), cache[1].clone())
    got = paged_attention(q, k, v, written, meta, 0.35)
    # the per-sequence reference: one sequence at a time (B = 1 takes the loop)
    want = []
    for i in range(4):
        one = AttentionMetadata([0, 1], [meta.context_lens[i]], meta.slot_mapping[i:i + 1],
                                [meta.gather_slots[i]])
        want.append(paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                    (cache[0].clone(), cache[1].clone()), one, 0.35))
    want = torch.cat(want)
    assert got.shape == (4, 4 * 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the new tokens' K/V were written to their slots (and read back from there)
    assert torch.equal(written[0][meta.slot_mapping], k)
    assert torch.equal(written[1][meta.slot_mapping], v)
