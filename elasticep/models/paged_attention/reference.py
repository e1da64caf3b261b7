"""Torch reference of paged attention: gather each sequence's keys by its block table.

Runs on any device with plain torch ops (CPU CI uses it, and the kernels are tested
against it). It pads to ``[B, max_query_len]`` queries and ``[B, max_seq_len]`` keys,
so it reads every sequence's cache once per call and holds a ``[B, Hq, max_query_len,
max_seq_len]`` score tensor: right for CPU and for checking, not for GPU speed.
"""

from __future__ import annotations

import torch

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged keys, in fp32.

    Args:
        q: ``[T, Hq, D]`` bf16/fp32, RoPE applied; ``Hq = g * Hkv`` (GQA).
        k_cache, v_cache: ``[num_blocks * block_size, Hkv, D]``; slot ``b * block_size + j``
            is token ``j`` of block ``b``; this step's K/V are already written.
        meta: block tables and lengths, on q's device (see :class:`PagedAttentionMetadata`).
        scale: softmax scale (``D ** -0.5`` for the Qwen/Mixtral families).

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    g = Hq // Hkv
    B = meta.num_seqs
    if T == 0 or B == 0:
        return q.new_empty(T, Hq, D)
    max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
    # keys: [B, S] slots through the block table; positions past a sequence are masked.
    # index_select, not advanced indexing: several times faster for row gathers on CPU.
    lay = meta.dense_layout(T, k_cache.shape[0])
    k = k_cache.index_select(0, lay.key_slots).view(B, max_seq_len, Hkv, D).float()
    v = v_cache.index_select(0, lay.key_slots).view(B, max_seq_len, Hkv, D).float()
    qb = q.index_select(0, lay.query_rows).float().view(B, max_query_len, Hkv, g, D)
    scores = torch.einsum("bqhgd,bshd->bhgqs", qb, k) * scale  # [B, Hkv, g, Mq, S]
    scores = scores.masked_fill(~lay.visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgqs,bshd->bqhgd", probs, v).reshape(B * max_query_len, Hq, D)
    return o.index_select(0, lay.token_cells).to(q.dtype)
