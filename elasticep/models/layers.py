"""Functional building blocks shared by the MoE families: RMSNorm, paged attention.

All functions are stateless; weights are passed in. Numerics follow the transformers
implementations of qwen3_moe / qwen2_moe / mixtral (RMSNorm in float32, softmax attention
via SDPA); RoPE lives in :mod:`elasticep.models.rope`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward pass sit, per sequence.

    The batch is flat: sequence ``i`` owns tokens ``[query_starts[i], query_starts[i+1])``
    of the ``T`` input tokens, which are the last ``query_lens[i]`` of its
    ``context_lens[i]`` tokens.

    Attributes:
        query_starts: ``[B+1]`` python ints, cumulative query lengths.
        context_lens: ``[B]`` python ints, tokens in the sequence after this step.
        slot_mapping: ``[T]`` int64, the flat KV-cache slot each new token writes.
        gather_slots: per sequence ``[context_lens[i]]`` int64, the KV-cache slots to read.
    """

    query_starts: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor
    gather_slots: list[torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back like transformers."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over each sequence's cached + new keys.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (RoPE already applied to q, k).
        kv_cache: ``(k_cache, v_cache)`` each ``[num_slots, Hkv, D]``, or None when
            every sequence is a full prefill (then k, v are used directly).
        meta: token placement, see :class:`AttentionMetadata`.
        scale: softmax scale, ``head_dim ** -0.5``.

    Returns:
        ``[T, Hq * D]`` in q's dtype.

    KV writes go to ``meta.slot_mapping`` and rewrite the same slots on a redo, so a
    step can be repeated after a failure without corrupting the cache.
    """
    if kv_cache is not None:
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    n_rep = q.shape[1] // k.shape[1]
    if not meta.context_lens:  # empty step of an idle EP rank
        return q.new_zeros(0, q.shape[1] * q.shape[2])
    if kv_cache is not None and len(meta.context_lens) == q.shape[0] > 1:
        return _decode_attention(q, kv_cache, meta, scale, n_rep)
    outs = []
    for i, ctx in enumerate(meta.context_lens):
        s, e = meta.query_starts[i], meta.query_starts[i + 1]
        n = e - s
        if kv_cache is None:
            ks, vs = k[s:e], v[s:e]
        else:
            ks = k_cache.index_select(0, meta.gather_slots[i])
            vs = v_cache.index_select(0, meta.gather_slots[i])
        qh = q[s:e].transpose(0, 1)  # [Hq, n, D]
        kh = ks.transpose(0, 1).repeat_interleave(n_rep, dim=0)  # [Hq, ctx, D]
        vh = vs.transpose(0, 1).repeat_interleave(n_rep, dim=0)
        if n == ctx:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            # query j sits at position ctx - n + j and sees keys 0..ctx-n+j
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1).reshape(n, -1))
    return torch.cat(outs, dim=0)


def _decode_attention(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: AttentionMetadata, scale: float, n_rep: int) -> torch.Tensor:
    """A decode step (one new token per sequence, ``q [B, Hq, D]``) as one batched SDPA.

    Each sequence's cached keys are gathered into ``[B, L, Hkv, D]`` with ``L`` the
    longest context; the padding is masked out. A per-sequence loop would launch a
    handful of kernels per sequence per layer, which bounds a GPU decode step by the
    host, not the device.
    """
    k_cache, v_cache = kv_cache
    B = q.shape[0]
    slots = torch.nn.utils.rnn.pad_sequence(meta.gather_slots, batch_first=True)  # [B, L]
    L = slots.shape[1]
    lens = torch.tensor(meta.context_lens, device=q.device)
    valid = torch.arange(L, device=q.device)[None, :] < lens[:, None]  # [B, L]
    kh = k_cache[slots].transpose(1, 2).repeat_interleave(n_rep, dim=1)  # [B, Hq, L, D]
    vh = v_cache[slots].transpose(1, 2).repeat_interleave(n_rep, dim=1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kh, vh, attn_mask=valid[:, None, None, :],
                                       scale=scale)  # [B, Hq, 1, D]
    return o.reshape(B, -1)
