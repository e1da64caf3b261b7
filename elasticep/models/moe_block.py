"""The sparse MoE block: router (top-k over logical experts), executor call, shared expert.

The block computes router logits itself and hands the routed compute to an *expert
executor* (docs/ARCHITECTURE.md, "MoE layer"), so the same model code runs with the
single-rank :class:`elasticep.moe.local_executor.LocalExpertExecutor` or an EP executor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# executor(layer_idx, hidden [T, H], topk_ids [T, k] int64, topk_weights [T, k] fp32) -> [T, H]
ExpertExecutor = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DenseMLPWeights:
    """SwiGLU MLP: gate/up ``[I, H]``, down ``[H, I]``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class MoEBlockWeights:
    """Non-expert weights of one MoE block.

    Attributes:
        router: ``[E, H]`` router (``mlp.gate`` / ``block_sparse_moe.gate``).
        shared: qwen2_moe shared expert, or None.
        shared_gate: ``[1, H]`` qwen2_moe sigmoid gate of the shared expert, or None.
    """

    router: torch.Tensor
    shared: DenseMLPWeights | None = None
    shared_gate: torch.Tensor | None = None


def dense_mlp(x: torch.Tensor, w: DenseMLPWeights) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x [T, H]``."""
    return F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)


def route(
    hidden_states: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, as transformers does it for all three families.

    Args:
        hidden_states: ``[T, H]`` model dtype.
        router: ``[E, H]``.
        top_k: experts per token.
        norm_topk_prob: renormalise the k weights to sum to 1 (mixtral always does,
            which equals a softmax over the top-k logits).

    Returns:
        ``topk_ids [T, k]`` int64 logical ids, ``topk_weights [T, k]`` float32.
    """
    logits = F.linear(hidden_states, router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if hidden_states.dtype != torch.float32:
        # qwen families cast routing weights to the model dtype before combining
        weights = weights.to(hidden_states.dtype).float()
    return ids, weights


def moe_block(
    layer_idx: int,
    x: torch.Tensor,
    w: MoEBlockWeights,
    executor: ExpertExecutor,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """Routed experts (via ``executor``) plus the optional sigmoid-gated shared expert.

    Args:
        x: ``[T, H]`` normalised hidden states, model dtype.

    Returns:
        ``[T, H]`` model dtype.
    """
    ids, weights = route(x, w.router, top_k, norm_topk_prob)
    out = executor(layer_idx, x, ids, weights)
    if w.shared is not None:
        shared = dense_mlp(x, w.shared)
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, w.shared_gate)) * shared
        out = out + shared
    return out
