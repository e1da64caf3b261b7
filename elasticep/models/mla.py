"""Multi-head Latent Attention (MLA), DeepSeek-V2 paper sec. 2.1, over the paged cache.

Per token the cache keeps only the normalised KV latent ``c_kv`` (``kv_lora_rank``
values) and the shared rotary key ``k_pe`` (``qk_rope_head_dim``), one row of
``kv_lora_rank + qk_rope_head_dim`` per layer instead of full per-head K and V.

Two equal ways to attend over it:
- expanded (prefill): up-project the latents with ``kv_b`` into per-head K_nope and V
  and run ordinary attention, cheap when many queries share the keys;
- absorbed (decode): fold ``W_UK`` into the query (``q_nope @ W_UK`` lives in latent
  space), score against the latents directly, and apply ``W_UV`` after the weighted sum,
  so a decode step never expands the context.

Rotary dims are kept in the half-split layout: the loader de-interleaves DeepSeek's
pair layout once (:func:`elasticep.models.rope.deinterleave_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

from elasticep.models.layers import AttentionMetadata, rms_norm
from elasticep.models.linear import Weight, linear
from elasticep.models.rope import apply_rope


@dataclass(frozen=True)
class MLAConfig:
    """MLA sizes from a DeepSeek config.

    Attributes:
        num_heads: query heads.
        q_lora_rank: rank of the query down-projection, None for a plain ``q_proj``
            (DeepSeek-V2-Lite).
        kv_lora_rank: r, width of the cached KV latent.
        qk_nope_head_dim, qk_rope_head_dim: per-head query/key widths without and with RoPE.
        v_head_dim: per-head value width.
        rope_interleave: the checkpoint rotates interleaved pairs (DeepSeek's layout).
    """

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head, nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token per layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def projection_shapes(self, hidden_size: int) -> dict[str, tuple[int, int]]:
        """``[out, in]`` of each of one layer's MLA projections, by HF module name."""
        q_out = self.num_heads * self.qk_head_dim
        q = ({"q_proj": (q_out, hidden_size)} if self.q_lora_rank is None else
             {"q_a_proj": (self.q_lora_rank, hidden_size), "q_b_proj": (q_out, self.q_lora_rank)})
        return {**q, "kv_a_proj_with_mqa": (self.cache_width, hidden_size),
                "kv_b_proj": (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim),
                              self.kv_lora_rank),
                "o_proj": (hidden_size, self.num_heads * self.v_head_dim)}

    def weight_params(self, hidden_size: int) -> int:
        """Parameters of one layer's MLA projections (the attention weights a step reads)."""
        return sum(n * k for n, k in self.projection_shapes(hidden_size).values())

    def full_kv_width(self) -> int:
        """Values per token per layer that plain MHA with these heads would cache (K and V)."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)


@dataclass(kw_only=True)
class MLAWeights:
    """One layer's MLA projections (HF names in brackets), rotary rows half-split.

    Every projection but ``kv_b`` may be block FP8 (:class:`~elasticep.models.linear.Fp8Weight`).
    ``kv_b`` is always a plain tensor: the absorbed decode reads it as the per-head
    ``W_UK`` and ``W_UV`` matrices of batched matmuls, not as one linear (SGLang, too,
    holds it dequantized for that form).

    Attributes:
        q: ``[Hn*(dn+dr), H]`` (``q_proj``), when there is no query LoRA.
        q_a: ``[rq, H]`` (``q_a_proj``), q_a_norm ``[rq]``, q_b ``[Hn*(dn+dr), rq]`` (``q_b_proj``).
        kv_a: ``[r+dr, H]`` (``kv_a_proj_with_mqa``), kv_a_norm ``[r]``.
        kv_b: ``[Hn*(dn+dv), r]`` (``kv_b_proj``): W_UK and W_UV, head by head.
        o: ``[H, Hn*dv]`` (``o_proj``).
    """

    # the query side is either ``q`` alone or the ``q_a``/``q_a_norm``/``q_b`` LoRA
    q: Weight | None = None
    q_a: Weight | None = None
    q_a_norm: torch.Tensor | None = None
    q_b: Weight | None = None
    kv_a: Weight
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor
    o: Weight


def _queries(x: torch.Tensor, w: MLAWeights, cfg: MLAConfig, eps: float) -> torch.Tensor:
    """``x [T, H]`` -> ``[T, Hn, dn+dr]``."""
    if w.q is not None:
        q = linear(x, w.q)
    else:
        q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, eps), w.q_b)
    return q.view(x.shape[0], cfg.num_heads, cfg.qk_head_dim)


def _expanded(q: torch.Tensor, latents: torch.Tensor, w: MLAWeights, cfg: MLAConfig,
              scale: float) -> torch.Tensor:
    """Causal attention of ``q [n, Hn, dn+dr]`` (the last n of ``ctx`` tokens) over
    ``latents [ctx, r+dr]``, with keys/values up-projected -> ``[n, Hn*dv]``."""
    n, ctx = q.shape[0], latents.shape[0]
    k, v = _keys_values(latents, w, cfg)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if n == ctx:
        # a whole prompt: plain causal attention, which SDPA's fused kernels take (an
        # explicit mask sends it to the math path: fp32 GEMMs and a [H, n, n] softmax,
        # 95% of an 8192-token DeepSeek-V2-Lite step on the H200). On CUDA the values are
        # zero-padded to the query width, which the flash kernel needs.
        dv = vh.shape[-1]
        if q.is_cuda and dv != qh.shape[-1]:
            vh = F.pad(vh, (0, qh.shape[-1] - dv))
        # [1, H, n, d]: SDPA's fused kernels take 4-D inputs only (3-D ran the math path)
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True,
                                           scale=scale)[0, ..., :dv]
    else:
        # query j sits at position ctx - n + j and sees keys 0..ctx-n+j
        mask = (torch.arange(ctx, device=q.device)[None, :]
                <= torch.arange(ctx - n, ctx, device=q.device)[:, None])
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(0, 1).reshape(n, -1)


def _keys_values(latents: torch.Tensor, w: MLAWeights, cfg: MLAConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents [n, r+dr]`` up-projected -> keys ``[n, Hn, dn+dr]``, values ``[n, Hn, dv]``."""
    n, r = latents.shape[0], cfg.kv_lora_rank
    kv = F.linear(latents[:, :r], w.kv_b).view(n, cfg.num_heads, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k_pe = latents[:, None, r:].expand(n, cfg.num_heads, cfg.qk_rope_head_dim)
    return torch.cat((k_nope, k_pe), dim=-1), v


# Whole prompts run as one SDPA call over a padded [B, L] grid (L the longest prompt)
# when no prompt is long and the grid holds at most PADDED_MAX_WASTE times the step's
# tokens: then each per-sequence call would be mostly launch overhead (16 x 128 tokens of
# DeepSeek-V2-Lite's shape took 140 ms a step on the H200 with one call per sequence,
# against 60 ms for 1 x 2048). From PADDED_MAX_PROMPT tokens on, a prompt's own FLOPs
# dominate and padding would only add to them, so those keep one call per sequence.
PADDED_MAX_PROMPT = 1024
PADDED_MAX_WASTE = 2.0


def padded_prefill_ok(query_lens: list[int]) -> bool:
    """The rule above (pure): True when the whole prompts of ``query_lens`` (tokens of
    each) are better computed as one padded batch than one sequence at a time."""
    if len(query_lens) < 2:
        return False
    L = max(query_lens)
    return L < PADDED_MAX_PROMPT and len(query_lens) * L <= PADDED_MAX_WASTE * sum(query_lens)


def _padded_prompts(q: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata,
                    w: MLAWeights, cfg: MLAConfig, scale: float) -> torch.Tensor:
    """Causal attention of whole prompts, ``q [T, Hn, dn+dr]`` over this step's own
    ``latent [T, r+dr]``, as one SDPA call over the padded grid -> ``[T, Hn*dv]``.

    Padding cells repeat their sequence's last token and sit after it, so a causal mask
    (no explicit mask: SDPA's fused kernels take it) hides them from every real query;
    their own rows are dropped.
    """
    T = q.shape[0]
    rows, cells, L = meta.padded_layout
    B = rows.numel() // L
    k, v = _keys_values(latent, w, cfg)
    qh, kh, vh = (x.index_select(0, rows).view(B, L, *x.shape[1:]).transpose(1, 2)
                  for x in (q, k, v))  # [B, Hn, L, d]
    dv = vh.shape[-1]
    if q.is_cuda and dv != qh.shape[-1]:  # the flash kernel wants equal widths
        vh = F.pad(vh, (0, qh.shape[-1] - dv))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[..., :dv]
    return o.transpose(1, 2).reshape(B * L, -1).index_select(0, cells).view(T, -1)


def _absorbed_decode(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, w: MLAWeights,
                     cfg: MLAConfig, scale: float) -> torch.Tensor:
    """One query per sequence, ``q [B, Hn, dn+dr]``, scored in latent space -> ``[B, Hn*dv]``.

    On CUDA (bf16/fp16) a Triton kernel reads the latents through the block tables
    (:mod:`elasticep.models.paged_attention.mla_decode`). The torch form below, its
    reference and the CPU path, gathers each sequence's latents into ``[B, L, r+dr]``
    (``L = max_seq_len``) with the padding masked out. Neither reads anything back to the
    host.
    """
    r, paged = cfg.kv_lora_rank, meta.paged
    w_b = w.kv_b.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, r)
    w_uk, w_uv = w_b[:, : cfg.qk_nope_head_dim], w_b[:, cfg.qk_nope_head_dim :]  # [Hn, dn, r], [Hn, dv, r]
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    q_lat = torch.cat((torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe), dim=-1)  # [B, Hn, r+dr]
    if q.is_cuda:  # the Triton kernel reads the latents in place (no [B, L] gather)
        from elasticep.models.paged_attention.mla_decode import mla_decode_attention, mla_decode_ok

        if mla_decode_ok(q_lat, cache, r):
            o_lat = mla_decode_attention(q_lat, cache, paged, r, scale)
            return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(q.shape[0], -1)
    pos = torch.arange(paged.max_seq_len, device=q.device)
    bs = paged.block_size
    slots = paged.block_tables.long()[:, pos // bs] * bs + pos % bs  # [B, L]
    valid = pos[None, :] < paged.seq_lens[:, None]
    lat = cache[slots]  # [B, L, r+dr]
    scores = torch.einsum("bhc,blc->bhl", q_lat, lat).float() * scale
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1).to(q.dtype)
    o_lat = torch.einsum("bhl,blr->bhr", probs, lat[..., :r])
    return torch.einsum("bhr,hvr->bhv", o_lat, w_uv).reshape(q.shape[0], -1)


def mla_attention(
    x: torch.Tensor,
    w: MLAWeights,
    cfg: MLAConfig,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    eps: float,
    absorb: bool | None = None,
    padded: bool | None = None,
) -> torch.Tensor:
    """MLA for a flat batch; writes each new token's latent row to the cache.

    Args:
        x: ``[T, H]`` normalised hidden states.
        cos, sin: ``[T, qk_rope_head_dim]`` rotary tables.
        cache: ``[num_slots, kv_lora_rank + qk_rope_head_dim]`` latent cache of this
            layer, or None when every sequence is a full prefill.
        meta: token placement (``query_starts``, ``context_lens``, ``slot_mapping``;
            with a cache also ``paged``: block tables and lengths).
        scale: softmax scale, ``qk_head_dim ** -0.5`` times YaRN's mscale.
        eps: RMSNorm epsilon of the q/kv latent norms.
        absorb: None picks the absorbed form for decode steps (one new token per
            sequence, cache present) and the expanded form otherwise; False forces
            expanded; True forces absorbed.
        padded: for the expanded form of a step of whole prompts only: None picks one
            SDPA call over the padded batch where :func:`padded_prefill_ok`, else one
            call per sequence; False forces per sequence; True forces padded.

    Returns:
        ``[T, H]`` after ``o_proj``.

    Raises:
        ValueError: ``absorb=True`` on a batch that is not a decode step;
            ``padded=True`` on one that is not all whole prompts.

    Cache writes go to ``meta.slot_mapping`` and a redo rewrites the same rows.
    """
    t = x.shape[0]
    q = _queries(x, w, cfg, eps)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    q = torch.cat((q_nope, apply_rope(q_pe, cos, sin)), dim=-1)
    c_kv, k_pe = linear(x, w.kv_a).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    latent = torch.cat((rms_norm(c_kv, w.kv_a_norm, eps), apply_rope(k_pe[:, None], cos, sin)[:, 0]), dim=-1)
    if cache is not None:
        cache.index_copy_(0, meta.slot_mapping, latent)
    if not meta.context_lens:  # empty step of an idle EP rank
        return linear(q.new_zeros(0, cfg.num_heads * cfg.v_head_dim), w.o)
    decode = cache is not None and len(meta.context_lens) == t
    if absorb and not decode:
        raise ValueError("the absorbed MLA form needs a decode step: one new token per sequence, with a cache")
    lens = [b - a for a, b in pairwise(meta.query_starts)]
    whole = lens == meta.context_lens
    if padded and (not whole or (decode if absorb is None else absorb)):
        raise ValueError("the padded MLA prefill needs a step of whole prompts")
    if decode if absorb is None else absorb:
        out = _absorbed_decode(q, cache, meta, w, cfg, scale)
    elif whole and (padded_prefill_ok(lens) if padded is None else padded):
        out = _padded_prompts(q, latent, meta, w, cfg, scale)
    else:
        outs = []
        for i in range(len(meta.context_lens)):
            s, e = meta.query_starts[i], meta.query_starts[i + 1]
            # a whole prompt's keys are its own latents, just written: none read back
            ctx = latent[s:e] if cache is None or whole else cache.index_select(
                0, meta.gather_slots[i])
            outs.append(_expanded(q[s:e], ctx, w, cfg, scale))
        out = torch.cat(outs, dim=0)
    return linear(out, w.o)
