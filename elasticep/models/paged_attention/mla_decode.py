"""Triton decode attention for MLA's absorbed form, reading the latent cache in place.

In the absorbed form (DeepSeek-V2, Sec. 2.1.2 and App. C) every query head attends over
the same per-token latent row ``[c_kv (r values) | k_pe (dr values)]`` of the paged
cache: the score of head ``h`` and key ``p`` is ``q_lat[h] . c_kv[p] + q_pe[h] . k_pe[p]``,
and the output is ``sum_p softmax(score)[p] * c_kv[p]`` (``r`` values; the caller then
applies ``W_UV``). That is multi-query attention with a key of ``r + dr`` values whose
first ``r`` are also the value.

A program owns one sequence, ``BLOCK_H`` query heads and one range of keys. Keys come
in ``BLOCK_N`` tiles whose slots are read from the block table, the softmax is online in
fp32 (FlashAttention), and a long context is split over several programs whose partial
results the paged-attention merge kernel combines (flash-decoding), as in
:mod:`elasticep.models.paged_attention.triton_kernels`. Grid sizes come from host ints
of the metadata (``max_seq_len``), so a CUDA graph captured with a fixed bound replays
it right, and nothing syncs the host.

The torch form (:func:`elasticep.models.mla._absorbed_decode`) is the reference and the
CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata
from elasticep.models.paged_attention.triton_kernels import (
    _LOG2E,
    _merge_splits_kernel,
    _num_sms,
    split_buffers,
)

BLOCK_H = 16  # query heads per program (tl.dot wants at least 16 rows)
BLOCK_N = 32  # keys per tile
MIN_SPLIT_TOKENS = 256  # a split covers at least this many keys


@triton.jit(do_not_specialize=["tiles_per_split"])  # as _paged_attn_kernel's
def _mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, tiles_per_split, num_heads, stride_qb, stride_qh, stride_cs, stride_bt,
    stride_ob, stride_oh,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_ok = h < num_heads
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    dr = tl.arange(0, R)
    dp = tl.arange(0, DR)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + dr[None, :], mask=h_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + R + dp[None, :], mask=h_ok[:, None], other=0.0)

    kv_lo = (split * tiles_per_split * BLOCK_N).to(tl.int32)
    kv_hi = tl.minimum(seq_len, kv_lo + tiles_per_split * BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        page = tl.load(bt_ptr + b * stride_bt + k_pos // PAGE, mask=k_ok, other=0)
        row = cache_ptr + (page.to(tl.int64) * PAGE + k_pos % PAGE)[:, None] * stride_cs
        lat = tl.load(row + dr[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, R]
        pe = tl.load(row + R + dp[None, :], mask=k_ok[:, None], other=0.0)  # [BLOCK_N, DR]
        s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_pe, tl.trans(pe))
        s = tl.where(k_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + h[:, None] * stride_oh + dr[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        part = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=h_ok)
        tl.store(part_l_ptr + part, l_i, mask=h_ok)
        tl.store(part_acc_ptr + part[:, None] * R + dr[None, :], acc, mask=h_ok[:, None])


def mla_decode_ok(q: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """True when :func:`mla_decode_attention` takes these inputs: CUDA, bf16/fp16, the
    latent widths powers of two (r = 512 and dr = 64 in DeepSeek-V2/V3), unit last stride."""
    r, dr = kv_lora_rank, cache.shape[-1] - kv_lora_rank
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and cache.dtype == q.dtype
            and r >= 16 and dr >= 16 and not r & (r - 1) and not dr & (dr - 1)
            and q.stride(-1) == 1 and cache.stride(-1) == 1)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: PagedAttentionMetadata,
                         kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA attention of one query token per sequence over the paged latent cache.

    Args:
        q: ``[B, Hn, r + dr]`` per head, ``[W_UK^T q_nope | rotated q_pe]`` (model dtype).
        cache: ``[num_slots, r + dr]`` the layer's latent cache (normed ``c_kv`` then
            rotated ``k_pe``).
        meta: the batch's block tables and lengths (one query per sequence).
        kv_lora_rank: r.
        scale: softmax scale (``qk_head_dim ** -0.5`` times YaRN's mscale).

    Returns:
        ``[B, Hn, r]`` in q's dtype: the attention-weighted sum of ``c_kv`` per head.

    Raises:
        ValueError: inputs :func:`mla_decode_ok` refuses, or not one query per sequence.
    """
    if not mla_decode_ok(q, cache, kv_lora_rank):
        raise ValueError("mla_decode_attention needs CUDA bf16/fp16 and power-of-two latent widths")
    B, Hn, W = q.shape
    if meta.num_seqs != B or meta.max_query_len > 1:
        raise ValueError("mla_decode_attention takes one query token per sequence")
    r = kv_lora_rank
    out = torch.empty(B, Hn, r, dtype=q.dtype, device=q.device)
    if B == 0 or meta.max_seq_len == 0:
        return out
    head_blocks = triton.cdiv(Hn, BLOCK_H)
    tiles = triton.cdiv(meta.max_seq_len, BLOCK_N)
    want = -(-4 * _num_sms(q.device) // (B * head_blocks))  # about four waves of programs
    splits = max(1, min(want, meta.max_seq_len // MIN_SPLIT_TOKENS, tiles))
    tiles_per_split = triton.cdiv(tiles, splits)
    part_acc, part_m, part_l = split_buffers(out, B, Hn, splits, r)
    _mla_decode_kernel[(B, head_blocks, splits)](
        q, cache, meta.block_tables, meta.seq_lens, out, part_acc, part_m, part_l,
        scale * _LOG2E, tiles_per_split, Hn, q.stride(0), q.stride(1), cache.stride(0),
        meta.block_tables.stride(0), out.stride(0), out.stride(1),
        R=r, DR=W - r, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, PAGE=meta.block_size,
        NUM_SPLITS=splits, num_warps=4, num_stages=2)
    if splits > 1:
        _merge_splits_kernel[(B, Hn)](
            out, part_acc, part_m, part_l, Hn, out.stride(0), out.stride(1),
            HEAD_D=r, BLOCK_D=r, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits))
    return out
