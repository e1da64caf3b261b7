"""Functional building blocks shared by the MoE families: RMSNorm, paged attention.

All functions are stateless; weights are passed in. Numerics follow the transformers
implementations of qwen3_moe / qwen2_moe / mixtral (RMSNorm in float32, softmax attention
via SDPA); RoPE lives in :mod:`elasticep.models.rope`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from elasticep.models.paged_attention import PagedAttentionMetadata
from elasticep.models.paged_attention import paged_attention as paged_attention_kernel


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward pass sit, per sequence.

    The batch is flat: sequence ``i`` owns tokens ``[query_starts[i], query_starts[i+1])``
    of the ``T`` input tokens, which are the last ``query_lens[i]`` of its
    ``context_lens[i]`` tokens.

    Attributes:
        query_starts: ``[B+1]`` python ints, cumulative query lengths.
        context_lens: ``[B]`` python ints, tokens in the sequence after this step.
        slot_mapping: ``[T]`` int64 on the model's device, the flat KV-cache slot each
            new token writes.
        paged: the same batch as device block tables and lengths, which paged
            attention reads the cache through; None when there is no cache.
    """

    query_starts: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    paged: PagedAttentionMetadata | None = None

    @functools.cached_property
    def gather_slots(self) -> list[torch.Tensor]:
        """Per sequence ``[context_lens[i]]`` int64, the cache slots of its tokens in order
        (for reference paths that gather; the kernels read the block tables)."""
        if self.paged is None:
            raise ValueError("no KV cache: this batch has no slots to gather")
        bs = self.paged.block_size
        tables = self.paged.block_tables.long()
        out = []
        for i, n in enumerate(self.context_lens):
            pos = torch.arange(n, device=tables.device)
            out.append(tables[i, pos // bs] * bs + pos % bs)
        return out


    @functools.cached_property
    def padded_layout(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The step's queries as a padded ``[B, L]`` grid (``L`` the longest query), for
        attention that batches sequences, built once per step on the host (one copy).

        Returns:
            ``(rows, cells, L)``: ``rows`` ``[B * L]`` int64, the token of each grid
            cell (cells past a sequence's end repeat its last token); ``cells`` ``[T]``
            int64, the grid cell ``i * L + j`` of each token; both on the device of
            ``slot_mapping``.
        """
        lens = [b - a for a, b in pairwise(self.query_starts)]
        L = max(lens, default=0)
        rows = [s + min(j, n - 1) for s, n in zip(self.query_starts, lens, strict=False)
                for j in range(L)]
        cells = [i * L + j for i, n in enumerate(lens) for j in range(n)]
        host = torch.tensor(rows + cells, dtype=torch.long)
        dev = self.slot_mapping.device
        flat = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
        return flat[:len(rows)], flat[len(rows):], L


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back like transformers."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    meta: AttentionMetadata,
    scale: float,
    written: bool = False,
) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached + new keys.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (RoPE already applied to q, k), or
            None when the caller already wrote them to ``kv_cache`` at
            ``meta.slot_mapping`` (:func:`elasticep.models.fused_norm_rope.qkv_norm_rope_cache`).
        kv_cache: ``(k_cache, v_cache)`` each ``[num_slots, Hkv, D]``, or None when
            every sequence is a full prefill (then k, v are used directly).
        meta: token placement, see :class:`AttentionMetadata`.
        scale: softmax scale, ``head_dim ** -0.5``.
        written: k and v (if given) are already in ``kv_cache``: the caller's fused
            kernel wrote them there and kept them for a :func:`flash_prefill` step.

    Returns:
        ``[T, Hq * D]`` in q's dtype.

    With a cache, the keys are read in place through ``meta.paged``'s block tables
    (:mod:`elasticep.models.paged_attention`: Triton on CUDA, the torch reference on
    CPU). KV writes go to ``meta.slot_mapping`` and rewrite the same slots on a redo,
    so a step can be repeated after a failure without corrupting the cache.
    """
    T = q.shape[0]
    if not meta.context_lens:  # empty step of an idle EP rank
        return q.new_zeros(0, q.shape[1] * q.shape[2])
    if kv_cache is not None:
        k_cache, v_cache = kv_cache
        if k is not None and v is not None and not written:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.paged is None:
            raise ValueError("a forward with a KV cache needs meta.paged (block tables)")
        if not flash_prefill(meta, q.is_cuda):
            return paged_attention_kernel(q, k_cache, v_cache, meta.paged, scale).reshape(T, -1)
        # Long whole prompts with no cached prefix: the keys are this step's own, so the
        # flash kernel of SDPA runs them (395 us a layer against the paged kernel's 603
        # at 4 x 2048 tokens on the H200; at 16 x 128 one SDPA call per sequence took
        # 870 us against 91). A caller whose fused q/k/v kernel wrote k and v only to
        # the cache has them read back (the model passes them instead, see flash_prefill).
        if k is None or v is None:
            k = k_cache.index_select(0, meta.slot_mapping)
            v = v_cache.index_select(0, meta.slot_mapping)
    elif not _all_full_prefills(meta):
        raise ValueError("without a KV cache every sequence must be a full prefill")
    return causal_prefill_attention(q, k, v, meta.query_starts, scale)


# Prefill steps whose sequences are all whole prompts of at least this many tokens take
# SDPA on CUDA instead of the paged kernel (which short, mixed and chunked batches keep:
# one launch for the whole batch).
FLASH_PREFILL_MIN_SEQ_TOKENS = 1024


def flash_prefill(meta: AttentionMetadata, cuda: bool) -> bool:
    """True when :func:`paged_attention` runs this step (with a cache) as SDPA over the
    step's own keys: on CUDA, every sequence a whole prompt of at least
    :data:`FLASH_PREFILL_MIN_SEQ_TOKENS` tokens. Such a step needs k and v as tensors,
    so a caller that fuses the cache writes also keeps them."""
    return (cuda and bool(meta.context_lens) and _all_full_prefills(meta)
            and min(meta.context_lens) >= FLASH_PREFILL_MIN_SEQ_TOKENS)


def _all_full_prefills(meta: AttentionMetadata) -> bool:
    """True when every sequence's query is its whole context (no cached prefix)."""
    return all(meta.query_starts[i + 1] - meta.query_starts[i] == ctx
               for i, ctx in enumerate(meta.context_lens))


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             query_starts: list[int], scale: float) -> torch.Tensor:
    """Causal self-attention of whole prompts packed in one batch, one SDPA call each.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (RoPE applied), sequence ``i`` at rows
            ``[query_starts[i], query_starts[i+1])``; ``Hq`` a multiple of ``Hkv`` (GQA).
        query_starts: ``[B+1]`` python ints.
        scale: softmax scale.

    Returns:
        ``[T, Hq * D]`` in q's dtype. On CUDA the KV heads are shared through SDPA's
        ``enable_gqa`` (the flash kernel); on CPU they are repeated, as transformers does.
    """
    n_rep = q.shape[1] // k.shape[1]
    lens = {e - s for s, e in pairwise(query_starts)}
    if q.is_cuda and len(lens) == 1 and len(query_starts) > 2:
        # equal prompts (a benchmark's, or a batch of one length): one SDPA call over
        # [B, H, n, D] views, and no concatenation of per-sequence outputs after
        n = lens.pop()
        qb, kb, vb = (x.view(-1, n, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                           enable_gqa=n_rep > 1)
        return o.transpose(1, 2).reshape(q.shape[0], -1)
    outs = []
    for s, e in zip(query_starts[:-1], query_starts[1:], strict=True):
        qh, kh, vh = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        if q.is_cuda:
            o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True,
                                               scale=scale, enable_gqa=n_rep > 1)[0]
        else:
            kh = kh.repeat_interleave(n_rep, dim=0)
            vh = vh.repeat_interleave(n_rep, dim=0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1).reshape(e - s, -1))
    return torch.cat(outs, dim=0)
