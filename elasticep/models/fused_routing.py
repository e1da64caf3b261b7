"""Softmax top-k routing in one Triton kernel (the Qwen3-MoE / Mixtral rule).

:func:`elasticep.models.routing.route` in torch is about eight kernels per layer at
decode (cast, softmax, top-k's two sorts, sum, divide, scale, the dtype round trip);
this is one. It covers ``scoring_func == "softmax"`` with ``topk_method == "greedy"``;
the grouped and sigmoid rules of DeepSeek stay on the torch path.

Equal scores are broken towards the lower expert id. The softmax sums in another
order than torch's, so a near tie may resolve differently from the reference.
"""

from __future__ import annotations

import torch

from elasticep.models.fused_norm_rope import fused_ok
from elasticep.moe.softmax_topk import SoftmaxTopk

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton; routing.route serves them
    triton = None

if triton is not None:
    from elasticep.moe.softmax_topk import kernel_args, softmax_topk_row

    @triton.jit
    def _softmax_topk_kernel(logits_ptr, ids_ptr, w_ptr, E, scale,
                             K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                             NORM: tl.constexpr, ROUND_BF16: tl.constexpr,
                             ROUND_F16: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        ids, w = softmax_topk_row(logits_ptr + t * E, E, scale, K, BLOCK_K, BLOCK_E, NORM,
                                  ROUND_BF16, ROUND_F16)
        ks = tl.arange(0, BLOCK_K)  # k rounded up to a power of two; the rest stay 0
        k_ok = ks < K
        tl.store(ids_ptr + t * K + ks, ids.to(tl.int64), mask=k_ok)
        tl.store(w_ptr + t * K + ks, w, mask=k_ok)


def fused_softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, scale: float,
                       model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k, optional renormalisation, scale, dtype round trip.

    Args:
        logits: ``[T, E]`` router logits (any float dtype), CUDA.
        top_k: k (any k up to E; DeepSeek-V2-Lite has 6).
        norm_topk_prob: renormalise the k weights to sum to 1.
        scale: ``routed_scaling_factor``.
        model_dtype: weights are rounded through it (bf16 / fp16) as in the reference.

    Returns:
        ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` float32, as
        :func:`elasticep.models.routing.route`.
    """
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        rule = SoftmaxTopk(top_k, norm_topk_prob, scale)
        _softmax_topk_kernel[(T,)](logits.contiguous(), ids, weights, E, scale,
                                   BLOCK_K=triton.next_power_of_2(top_k),
                                   **kernel_args(rule, E, model_dtype))
    return ids, weights


def fused_route_ok(logits: torch.Tensor, scoring_func: str, topk_method: str, top_k: int) -> bool:
    """True when :func:`fused_softmax_topk` implements this rule for ``logits``."""
    return (fused_ok(logits) and scoring_func == "softmax" and topk_method == "greedy"
            and 0 < top_k <= logits.shape[-1] <= 4096)
