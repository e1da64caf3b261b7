"""The softmax top-k rule of one router row: a Triton device function and its torch
reference.

The Qwen3-MoE / Mixtral rule (HF ``Qwen3MoeSparseMoeBlock``): softmax over the E router
logits in float32, the k largest probabilities (equal scores go to the lower expert id),
optionally renormalised to sum to 1, times ``routed_scaling_factor``, and rounded through
the model dtype as the reference models combine. Two kernels run it:
:func:`elasticep.models.fused_routing.fused_softmax_topk` (routing alone) and the
same-host exchange's fused dispatch, which routes a one-token step inside its send
(:func:`elasticep.moe.fused_exchange_kernels.routed_dispatch`), so a decode layer launches one
kernel fewer. Both call :func:`softmax_topk_row`, so they pick the same experts with the
same weights bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton: the torch reference serves them
    triton = None


@dataclass(frozen=True)
class SoftmaxTopk:
    """A layer's softmax top-k rule, as the executor's fused routing takes it.

    Attributes:
        top_k: k experts per token.
        norm_topk_prob: renormalise the k weights to sum to 1 (HF config field).
        routed_scaling_factor: multiplies the final weights (HF config field; 1.0 for
            the Qwen families).
    """

    top_k: int
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


def softmax_topk_reference(logits: torch.Tensor, rule: SoftmaxTopk,
                           model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in torch (CPU or CUDA).

    Args:
        logits: ``[T, E]`` router logits, any float dtype.
        rule: the layer's rule.
        model_dtype: the weights are rounded through it unless it is float32.

    Returns:
        ``topk_ids [T, k]`` int64 and ``topk_weights [T, k]`` float32. torch's top-k may
        order equal scores differently from :func:`softmax_topk_row`.
    """
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), rule.top_k, dim=-1)
    return ids, finish_weights(weights, rule.norm_topk_prob, rule.routed_scaling_factor,
                               model_dtype)


def finish_weights(weights: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float,
                   model_dtype: torch.dtype) -> torch.Tensor:
    """The chosen experts' ``[T, k]`` float32 scores as combine weights (every routing
    rule ends so, as the HF routers do): renormalised to sum to 1 if ``norm_topk_prob``,
    times ``routed_scaling_factor``, rounded through ``model_dtype`` unless float32 (the
    reference models combine in the model dtype). Returns ``[T, k]`` float32."""
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    if model_dtype != torch.float32:
        weights = weights.to(model_dtype).float()
    return weights


if triton is not None:

    @triton.jit
    def softmax_topk_row(row_ptr, E, scale, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                         ROUND_BF16: tl.constexpr, ROUND_F16: tl.constexpr):
        """The rule on the E logits at ``row_ptr``: returns ``(ids, weights)``, each
        ``[BLOCK_K]`` (int32 expert ids, float32 final weights), lanes ``>= K`` zero.
        The results do not depend on ``BLOCK_K`` (any power of two ``>= K``)."""
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(mask, p, -1.0)
        ks = tl.arange(0, BLOCK_K)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        # the k weights' sum, added in pick order: a lane reduction's order would depend
        # on BLOCK_K, and the two kernels that call this use different widths
        total = 0.0
        for j in tl.static_range(K):  # k passes of arg-max, lowest id on ties
            m = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == m, offs, BLOCK_E), axis=0)
            w = tl.where(ks == j, m, w)
            ids = tl.where(ks == j, idx, ids)
            p = tl.where(offs == idx, -1.0, p)
            total = total + m
        if NORM:
            w = w / (total + 1e-20)
        w = w * scale
        if ROUND_BF16:  # the reference models combine in the model dtype
            w = w.to(tl.bfloat16).to(tl.float32)
        if ROUND_F16:
            w = w.to(tl.float16).to(tl.float32)
        return ids, w


def kernel_args(rule: SoftmaxTopk, num_experts: int, model_dtype: torch.dtype) -> dict:
    """The constexpr arguments of :func:`softmax_topk_row` for ``rule`` (needs triton)."""
    return dict(K=rule.top_k, BLOCK_E=triton.next_power_of_2(num_experts),
                NORM=rule.norm_topk_prob, ROUND_BF16=model_dtype == torch.bfloat16,
                ROUND_F16=model_dtype == torch.float16)
