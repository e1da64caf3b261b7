"""Triton paged attention: reads K/V in place from the paged cache (decode and prefill).

One kernel serves decode, prefill and mixed batches. A program owns one sequence, one
tile of ``BLOCK_Q`` of its query tokens and one KV head, with all ``g`` query heads of
that KV head stacked as rows (``BLOCK_Q * BLOCK_G`` rows), so each K/V tile is loaded
once per group, not once per query head (GQA). Keys are visited in ``BLOCK_N`` tiles
whose slots come from the block table, with an online softmax in fp32 (FlashAttention,
Dao et al. 2022). For decode at small batch or long context the key range is also
split over ``num_splits`` programs whose partial results a second kernel merges by
their log-sum-exp (flash-decoding, Dao et al. 2023; the split-KV scheme of vLLM's
paged attention v2).

The grid is sized from host ints (``max_query_len``, ``max_seq_len``), and programs
past their sequence's end return at once, so nothing here syncs the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from elasticep.models.paged_attention.metadata import PagedAttentionMetadata

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes and launch settings; defaults suit head dim 128 on Hopper.

    Attributes:
        block_n: keys per inner tile (power of two, >= 16).
        prefill_rows: (query token, head) rows per program when ``max_query_len > 1``
            and the dtype is bf16/fp16 (a power of two); fp32 uses 16 rows, since its
            exact (non-TF32) dots spill registers on larger tiles (ptxas, sm_90).
        num_splits: key-range splits; None picks enough to fill the GPU for decode, and
            no split for prefill.
        min_split_tokens: a decode split covers at least this many keys (auto mode).
        num_warps, num_stages: Triton launch settings (``prefill_num_warps`` for
            prefill: 128 rows at 4 warps spill registers on sm_90, 8 do not).
    """

    block_n: int = 64
    prefill_rows: int = 128
    num_splits: int | None = None
    min_split_tokens: int = 256
    num_warps: int = 4
    prefill_num_warps: int = 8
    num_stages: int = 2


# Triton compiles a kernel again for each new specialization of its int arguments (==1,
# divisible by 16, other). The key-tile count per program follows the longest sequence of
# a step and would give a batch of short prompts a compile of its own on the request path
# (seen: 0.8-1.0 s for the first 16 x 128 step after 4 x 512); it only bounds a loop. The
# block tables' stride is kept divisible by 16 by PagedAttentionMetadata.from_lists.
@triton.jit(do_not_specialize=["tiles_per_split"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, tiles_per_split, num_q_heads,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    q_tile = tl.program_id(1)
    hkv = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    # positions and counts in int32 (loop bounds of one type); token offsets in int64
    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    n_q = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= n_q:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # rows = (query token, head of the group) pairs
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = q_tile * BLOCK_Q + rows // BLOCK_G
    hg = rows % BLOCK_G
    row_ok = (tok < n_q) & (hg < G)
    head = hkv * G + hg
    q_pos = seq_len - n_q + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    t = q_start.to(tl.int64) + tok
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # keys [kv_lo, kv_hi): this split's share of what the tile's last query can see
    kv_need = tl.minimum(seq_len, seq_len - n_q + (q_tile + 1) * BLOCK_Q)
    kv_lo = (split * tiles_per_split * BLOCK_N).to(tl.int32)
    kv_hi = tl.minimum(kv_need, kv_lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        page = tl.load(bt_ptr + b * stride_bt + k_pos // PAGE, mask=k_ok, other=0)
        slot = page.to(tl.int64) * PAGE + k_pos % PAGE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + hkv * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + hkv * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (t * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_D + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_q_heads, stride_ot, stride_oh,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_D
    base = (t * num_q_heads + h) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_D + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 holds key 0, which every query sees
    w = tl.exp2(m - m_max)
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_buffers(out: torch.Tensor, rows: int, heads: int, splits: int, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The partial results of a split key range, as the merge kernel reads them: acc
    ``[rows, heads, splits, width]``, running max and sum ``[rows, heads, splits]``, all
    float32. One split needs none: ``out`` stands in (the kernels then never touch them)."""
    if splits == 1:
        return out, out, out
    acc = torch.empty(rows, heads, splits, width, dtype=torch.float32, device=out.device)
    m = torch.empty(rows, heads, splits, dtype=torch.float32, device=out.device)
    return acc, m, torch.empty_like(m)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, to exercise the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(cfg: TritonAttentionConfig, decode: bool, device: torch.device, batch: int,
                num_kv_heads: int, max_seq_len: int) -> int:
    """Key-range splits: as configured, else for decode enough programs for ~4 waves
    with no split shorter than ``min_split_tokens``, and none for prefill."""
    if cfg.num_splits is not None:
        return cfg.num_splits
    if not decode:
        return 1
    want = -(-4 * _num_sms(device) // (batch * num_kv_heads))
    return max(1, min(want, max_seq_len // cfg.min_split_tokens))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    config: TritonAttentionConfig | None = None,
) -> torch.Tensor:
    """Paged causal attention with Triton; same contract as ``paged_attention_reference``.

    Decode (``max_query_len == 1``) uses one query token per program and splits the key
    range as :class:`TritonAttentionConfig` says; prefill and mixed batches tile several
    query tokens per program (split only when ``num_splits`` is set). Runs on CUDA, or on CPU tensors under
    ``TRITON_INTERPRET=1``.

    Returns:
        ``[T, Hq, D]`` in q's dtype.
    """
    cfg = config or TritonAttentionConfig()
    T, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    g = Hq // Hkv
    B = meta.num_seqs
    max_query_len, max_seq_len = meta.max_query_len, meta.max_seq_len
    out = torch.empty_like(q)
    if T == 0 or B == 0 or max_seq_len == 0:
        return out
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the K/V caches need a contiguous last (head_dim) dim")
    decode = max_query_len == 1
    splits = _num_splits(cfg, decode, q.device, B, Hkv, max_seq_len)
    group = triton.next_power_of_2(g)
    rows = 16 if decode or q.dtype == torch.float32 else cfg.prefill_rows
    block_q = max(1, rows // group)
    block_g = max(group, 16 // block_q)  # tl.dot wants >= 16 rows
    tiles = triton.cdiv(max_seq_len, cfg.block_n)
    splits = max(1, min(splits, tiles))
    tiles_per_split = triton.cdiv(tiles, splits)
    block_d = max(16, triton.next_power_of_2(D))
    part_acc, part_m, part_l = split_buffers(out, T, Hq, splits, D)
    grid = (B, triton.cdiv(max_query_len, block_q), Hkv * splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        out, part_acc, part_m, part_l,
        scale * _LOG2E, tiles_per_split, Hq,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), meta.block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=g, BLOCK_G=block_g, BLOCK_Q=block_q, HEAD_D=D, BLOCK_D=block_d,
        BLOCK_N=cfg.block_n, PAGE=meta.block_size, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps if decode else cfg.prefill_num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _merge_splits_kernel[(T, Hq)](
            out, part_acc, part_m, part_l, Hq, out.stride(0), out.stride(1),
            HEAD_D=D, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
        )
    return out


__all__ = ["TritonAttentionConfig", "paged_attention_triton"]
