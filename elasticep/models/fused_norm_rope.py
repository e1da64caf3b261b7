"""Triton kernels for the small per-token ops of a decoder layer: RMSNorm (with the
residual add folded in) and the q/k RMSNorm followed by RoPE.

At decode batch sizes these ops move a few kilobytes each, so their cost is the number
of kernels, not bytes: the torch forms take about eight kernels per RMSNorm and six per
RoPE, which at Qwen3-30B-A3B's 48 layers is some 1,400 of a step's 4,700 kernels
(``bench/scale.py --only profile``). Each function here is one kernel on CUDA.

The kernels keep the rounding steps of the torch references
(:func:`elasticep.models.layers.rms_norm`, :func:`elasticep.models.rope.apply_rope`,
which follow transformers): the norm in float32 cast to the model dtype before the
weight multiply, and each RoPE product rounded before the sum. Reductions sum in
another order, so results may differ from the references in the last bit.
On CPU, or where Triton is missing, the references run.
"""

from __future__ import annotations

import os

import torch

from elasticep.models.layers import rms_norm as rms_norm_reference
from elasticep.models.rope import apply_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; the references serve them
    triton = None

# Set to 1 to run the torch references on CUDA too (a debugging aid).
DISABLE_ENV = "ELASTICEP_DISABLE_FUSED_NORM"


def fused_ok(x: torch.Tensor) -> bool:
    """True when the Triton kernels take ``x``: CUDA, Triton installed, not disabled."""
    return x.is_cuda and triton is not None and os.environ.get(DISABLE_ENV, "0") != "1"


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                             HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_DELTA:  # the residual add, rounded to the model dtype as torch's add is
            d = tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype),
                 mask=mask)

    @triton.jit
    def _norm_halves(a, b, wa, wb, rstd):
        # RMSNorm's scale and weight on both halves of a head (any shape; rstd broadcast):
        # the norm rounded to the model dtype before the weight multiply, as in torch
        a = (wa * (a.to(tl.float32) * rstd).to(a.dtype).to(tl.float32)).to(a.dtype)
        b = (wb * (b.to(tl.float32) * rstd).to(b.dtype).to(tl.float32)).to(b.dtype)
        return a, b

    @triton.jit
    def _rope_halves(a, b, ca, cb, sa, sb):
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-b, a); each product is
        # rounded to the model dtype before the sum, as in the torch form
        af, bf = a.to(tl.float32), b.to(tl.float32)
        out_a = ((af * ca).to(a.dtype).to(tl.float32) + (-bf * sa).to(a.dtype).to(tl.float32))
        out_b = ((bf * cb).to(a.dtype).to(tl.float32) + (af * sb).to(a.dtype).to(tl.float32))
        return out_a.to(a.dtype), out_b.to(a.dtype)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, tok, lo, D: tl.constexpr):
        ca = tl.load(cos_ptr + tok * D + lo).to(tl.float32)
        cb = tl.load(cos_ptr + tok * D + D // 2 + lo).to(tl.float32)
        sa = tl.load(sin_ptr + tok * D + lo).to(tl.float32)
        sb = tl.load(sin_ptr + tok * D + D // 2 + lo).to(tl.float32)
        return ca, cb, sa, sb

    @triton.jit
    def _norm_rope_row(src, w_ptr, cos_ptr, sin_ptr, tok, eps, HAS_NORM: tl.constexpr,
                       D: tl.constexpr):
        # one head's D values at src: RMSNorm (if HAS_NORM), then RoPE; returns both halves
        lo = tl.arange(0, D // 2)
        a = tl.load(src + lo)
        b = tl.load(src + D // 2 + lo)
        if HAS_NORM:
            af, bf = a.to(tl.float32), b.to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(af * af, axis=0) + tl.sum(bf * bf, axis=0)) / D + eps)
            a, b = _norm_halves(a, b, tl.load(w_ptr + lo).to(tl.float32),
                                tl.load(w_ptr + D // 2 + lo).to(tl.float32), rstd)
        ca, cb, sa, sb = _cos_sin(cos_ptr, sin_ptr, tok, lo, D)
        return _rope_halves(a, b, ca, cb, sa, sb)

    @triton.jit
    def _norm_rope_rows(src, ok, wa, wb, cos_ptr, sin_ptr, tok, eps, HAS_NORM: tl.constexpr,
                        D: tl.constexpr):
        # as _norm_rope_row for HEAD_BLOCK heads of one token at src[h] (a [HEAD_BLOCK, 1]
        # pointer column; rows with ok False are not read), the weight halves given as
        # [HEAD_BLOCK, D/2] float32
        lo = tl.arange(0, D // 2)[None, :]
        a = tl.load(src + lo, mask=ok, other=0.0)
        b = tl.load(src + D // 2 + lo, mask=ok, other=0.0)
        if HAS_NORM:
            af, bf = a.to(tl.float32), b.to(tl.float32)
            rstd = tl.math.rsqrt((tl.sum(af * af, axis=1) + tl.sum(bf * bf, axis=1)) / D + eps)
            a, b = _norm_halves(a, b, wa, wb, rstd[:, None])
        ca, cb, sa, sb = _cos_sin(cos_ptr, sin_ptr, tok, lo, D)
        return _rope_halves(a, b, ca, cb, sa, sb)

    @triton.jit
    def _store_rows(dst, ok, out_a, out_b, D: tl.constexpr):
        lo = tl.arange(0, D // 2)[None, :]
        tl.store(dst + lo, out_a, mask=ok)
        tl.store(dst + D // 2 + lo, out_b, mask=ok)

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_t, eps,
                          HAS_NORM: tl.constexpr, D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (token, head) row of D values
        tok = row // heads
        src = x_ptr + tok * stride_t + (row - tok * heads) * D  # tokens may be strided
        out_a, out_b = _norm_rope_row(src, w_ptr, cos_ptr, sin_ptr, tok, eps, HAS_NORM, D)
        lo = tl.arange(0, D // 2)
        tl.store(out_ptr + row * D + lo, out_a)
        tl.store(out_ptr + row * D + D // 2 + lo, out_b)

    @triton.jit
    def _norm_rope_block_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_t,
                                eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                                HEAD_BLOCK: tl.constexpr):
        # one token (axis 0) and HEAD_BLOCK of its heads (axis 1); tokens may be strided
        tok = tl.program_id(0).to(tl.int64)
        h = (tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)).to(tl.int64)[:, None]
        ok = h < heads
        lo = tl.arange(0, D // 2)[None, :]
        wa = tl.load(w_ptr + lo).to(tl.float32)
        wb = tl.load(w_ptr + D // 2 + lo).to(tl.float32)
        out_a, out_b = _norm_rope_rows(x_ptr + tok * stride_t + h * D, ok, wa, wb, cos_ptr,
                                       sin_ptr, tok, eps, HAS_NORM, D)
        _store_rows(out_ptr + (tok * heads + h) * D, ok, out_a, out_b, D)

    @triton.jit
    def _qkv_cache_kernel(qkv_ptr, stride_t, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr,
                          k_cache_ptr, v_cache_ptr, slot_ptr, k_out_ptr, hq, hkv, eps,
                          HAS_NORM: tl.constexpr, HAS_K_OUT: tl.constexpr, D: tl.constexpr):
        # one (token, head) of the fused projection: a q head goes (normed, rotated) to
        # q; a k head to the KV cache slot of its token (and, with HAS_K_OUT, to k_out);
        # a v head is copied there as is
        row = tl.program_id(0).to(tl.int64)
        nh = hq + 2 * hkv
        tok = row // nh
        h = row - tok * nh
        src = qkv_ptr + tok * stride_t + h * D
        lo = tl.arange(0, D // 2)
        if h >= hq + hkv:
            dst = v_cache_ptr + (tl.load(slot_ptr + tok) * hkv + (h - hq - hkv)) * D
            tl.store(dst + lo, tl.load(src + lo))
            tl.store(dst + D // 2 + lo, tl.load(src + D // 2 + lo))
        else:
            if h < hq:
                w_ptr = qw_ptr
                dst = q_ptr + (tok * hq + h) * D
            else:
                w_ptr = kw_ptr
                dst = k_cache_ptr + (tl.load(slot_ptr + tok) * hkv + (h - hq)) * D
            out_a, out_b = _norm_rope_row(src, w_ptr, cos_ptr, sin_ptr, tok, eps, HAS_NORM, D)
            tl.store(dst + lo, out_a)
            tl.store(dst + D // 2 + lo, out_b)
            if HAS_K_OUT and h >= hq:
                k_dst = k_out_ptr + (tok * hkv + (h - hq)) * D
                tl.store(k_dst + lo, out_a)
                tl.store(k_dst + D // 2 + lo, out_b)

    @triton.jit
    def _qkv_cache_block_kernel(qkv_ptr, stride_t, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr,
                                k_cache_ptr, v_cache_ptr, slot_ptr, k_out_ptr, hq, hkv, eps,
                                HAS_NORM: tl.constexpr, HAS_K_OUT: tl.constexpr,
                                D: tl.constexpr, HEAD_BLOCK: tl.constexpr):
        # _qkv_cache_kernel for one token (axis 0) and HEAD_BLOCK of its heads (axis 1),
        # each head's role (q, k, v) a row mask
        tok = tl.program_id(0).to(tl.int64)
        h = (tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)).to(tl.int64)[:, None]
        is_q = h < hq
        is_k = (h >= hq) & (h < hq + hkv)
        is_v = (h >= hq + hkv) & (h < hq + 2 * hkv)
        src = qkv_ptr + tok * stride_t + h * D
        slot = tl.load(slot_ptr + tok)
        lo = tl.arange(0, D // 2)[None, :]
        v_dst = v_cache_ptr + (slot * hkv + tl.where(is_v, h - hq - hkv, 0)) * D
        tl.store(v_dst + lo, tl.load(src + lo, mask=is_v, other=0.0), mask=is_v)
        tl.store(v_dst + D // 2 + lo, tl.load(src + D // 2 + lo, mask=is_v, other=0.0),
                 mask=is_v)
        wa = tl.where(is_q, tl.load(qw_ptr + lo), tl.load(kw_ptr + lo)).to(tl.float32)
        wb = tl.where(is_q, tl.load(qw_ptr + D // 2 + lo),
                      tl.load(kw_ptr + D // 2 + lo)).to(tl.float32)
        out_a, out_b = _norm_rope_rows(src, is_q | is_k, wa, wb, cos_ptr, sin_ptr, tok, eps,
                                       HAS_NORM, D)
        _store_rows(q_ptr + (tok * hq + tl.where(is_q, h, 0)) * D, is_q, out_a, out_b, D)
        kh = tl.where(is_k, h - hq, 0)
        _store_rows(k_cache_ptr + (slot * hkv + kh) * D, is_k, out_a, out_b, D)
        if HAS_K_OUT:
            _store_rows(k_out_ptr + (tok * hkv + kh) * D, is_k, out_a, out_b, D)


# From BLOCK_KERNEL_MIN_TOKENS tokens the norm/RoPE kernels take HEAD_BLOCK heads a
# program (Qwen3-30B-A3B's 32 + 4 + 4 q, k, v heads of a token in five programs): a head a
# program took 287 us a layer at 8192 tokens on the H200, the block form 58 us
# (bench/scale.py --only prefill). Decode-sized steps keep a program a head, the kernel
# the decode graphs were measured with: the block form at every size cost 0.16 ms a
# batch-1 decode step.
HEAD_BLOCK = 8
BLOCK_KERNEL_MIN_TOKENS = 128


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (one kernel on CUDA); as :func:`rms_norm_reference`.

    Args:
        x: ``[..., N]`` model dtype; weight: ``[N]``; eps: the config's ``rms_norm_eps``.

    Returns:
        ``[..., N]`` model dtype.
    """
    return add_rms_norm(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next RMSNorm in one kernel: ``h = x + delta``,
    returns ``(h, rms_norm(h))``.

    Args:
        x: ``[..., N]`` the residual stream, model dtype.
        delta: ``[..., N]`` what the last block adds (None: nothing, ``h`` is ``x``).
        weight: ``[N]`` the norm's weight; eps: its epsilon.

    Returns:
        ``(h, normed)``, both ``[..., N]`` in ``x``'s dtype.
    """
    if not fused_ok(x) or x.numel() == 0:
        h = x if delta is None else x + delta
        return h, rms_norm_reference(h, weight, eps)
    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    h = xc if delta is None else torch.empty_like(xc)
    _add_rms_norm_kernel[(xc.numel() // n,)](
        xc, xc if delta is None else delta.contiguous(), weight, out, h, n, eps,
        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return h, out


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm (if ``weight``) then RoPE, for q or k; one kernel on CUDA.

    Args:
        x: ``[T, heads, D]`` model dtype, D a power of two; each token's ``heads * D``
            values contiguous (tokens may be strided, as in a slice of a fused qkv).
        weight: ``[D]`` the q_norm / k_norm weight (Qwen3), or None.
        eps: the norm's epsilon.
        cos, sin: ``[T, D]`` in ``x``'s dtype (:func:`elasticep.models.rope.rope_cos_sin`).

    Returns:
        ``[T, heads, D]``: ``apply_rope(rms_norm(x, weight), cos, sin)``.
    """
    D = x.shape[-1]
    if (not fused_ok(x) or x.numel() == 0 or D & (D - 1) or cos.dtype != x.dtype
            or sin.dtype != x.dtype):
        if weight is not None:
            x = rms_norm_reference(x, weight, eps)
        return apply_rope(x, cos, sin)
    xc = x if x.stride(2) == 1 and x.stride(1) == D else x.contiguous()
    T, heads = xc.shape[0], xc.shape[1]
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    w, cos, sin = xc if weight is None else weight, cos.contiguous(), sin.contiguous()
    if T >= BLOCK_KERNEL_MIN_TOKENS:
        _norm_rope_block_kernel[(T, triton.cdiv(heads, HEAD_BLOCK))](
            xc, w, cos, sin, out, heads, xc.stride(0), eps, HAS_NORM=weight is not None, D=D,
            HEAD_BLOCK=HEAD_BLOCK)
    else:
        _norm_rope_kernel[(T * heads,)](xc, w, cos, sin, out, heads, xc.stride(0), eps,
                                        HAS_NORM=weight is not None, D=D)
    return out


def qkv_cache_ok(qkv: torch.Tensor, head_dim: int, cos: torch.Tensor,
                 k_cache: torch.Tensor) -> bool:
    """True when :func:`qkv_norm_rope_cache` takes these inputs (CUDA, Triton, D a power
    of two, unit column stride, cos/cache in the projection's dtype, contiguous cache)."""
    D = head_dim
    return (fused_ok(qkv) and qkv.shape[0] > 0 and not D & (D - 1) and qkv.stride(-1) == 1
            and cos.dtype == qkv.dtype and k_cache.dtype == qkv.dtype
            and k_cache.is_contiguous())


def qkv_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor | None,
                        k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor,
                        k_out: torch.Tensor | None = None) -> torch.Tensor:
    """After the fused q/k/v projection: q and k RMSNorm (if weights) and RoPE, k and v
    written to the KV cache, in one kernel; returns q.

    It replaces :func:`norm_rope` for q and k plus the two cache writes of
    :func:`elasticep.models.layers.paged_attention` (four kernels a layer) and rounds as
    they do.

    Args:
        qkv: ``[T, (Hq + 2*Hkv) * D]`` model dtype, q heads then k then v (tokens may be
            strided); see :func:`qkv_cache_ok`.
        q_norm, k_norm: ``[D]`` Qwen3's per-head norm weights, both or neither.
        eps: the norms' epsilon; cos, sin: ``[T, D]`` in qkv's dtype.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D.
        k_cache, v_cache: ``[num_slots, Hkv, D]`` contiguous.
        slot_mapping: ``[T]`` int64 cache slot of each token. Not range-checked.
        k_out: ``[T, Hkv, D]`` contiguous, or None: where the normed, rotated keys are
            written too (a whole-prompt step whose attention takes this step's keys
            directly, then reads none back from the cache).

    Returns:
        q: ``[T, Hq, D]``, normed and rotated.

    Raises:
        ValueError: only one of q_norm / k_norm given.
    """
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must both be given or both be None")
    T, D = qkv.shape[0], head_dim
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    w = qkv if q_norm is None else q_norm
    args = (qkv, qkv.stride(0), w, w if k_norm is None else k_norm, cos.contiguous(),
            sin.contiguous(), q, k_cache, v_cache, slot_mapping, q if k_out is None else k_out,
            num_heads, num_kv_heads, eps)
    flags = {"HAS_NORM": q_norm is not None, "HAS_K_OUT": k_out is not None, "D": D}
    nh = num_heads + 2 * num_kv_heads
    if T >= BLOCK_KERNEL_MIN_TOKENS:
        _qkv_cache_block_kernel[(T, triton.cdiv(nh, HEAD_BLOCK))](*args, **flags,
                                                                  HEAD_BLOCK=HEAD_BLOCK)
    else:
        _qkv_cache_kernel[(T * nh,)](*args, **flags)
    return q
