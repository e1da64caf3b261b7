"""The sparse MoE block: router (top-k over logical experts), executor call, shared expert.

The block computes router logits itself and hands the routed compute to an *expert
executor* (docs/ARCHITECTURE.md, "MoE layer"), so the same model code runs with the
single-rank :class:`elasticep.moe.local_executor.LocalExpertExecutor` or an EP executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elasticep.models.linear import Fp8Weight, Weight, cat_rows, linear
from elasticep.models.routing import RoutingConfig, fused_rule, route_logits, router_logits
from elasticep.moe.executor import ExpertExecutor


@dataclass
class DenseMLPWeights:
    """SwiGLU MLP: gate/up ``[I, H]``, down ``[H, I]``, plain or block FP8.

    After :meth:`fuse_gate_up`, FP8 gate and up may be one ``gate_up [2I, H]`` weight
    (gate and up become views of it).
    """

    gate: Weight
    up: Weight
    down: Weight
    gate_up: Weight | None = None

    def fuse_gate_up(self) -> None:
        """Stack FP8 gate and up into :attr:`gate_up` when I ends on a scale block (so
        their scale grids stack): one kernel then reads the input once for both, one
        launch fewer a decode step. Plain weights stay two projections, so the bf16
        path computes exactly what it did."""
        if isinstance(self.gate, Fp8Weight) and isinstance(self.up, Fp8Weight):
            self.gate_up = cat_rows([self.gate, self.up])
            if self.gate_up is not None:
                self.gate, self.up = self.gate_up.split([self.gate.shape[0], self.up.shape[0]])


@dataclass
class MoEBlockWeights:
    """Non-expert weights of one MoE block.

    Attributes:
        router: ``[E, H]`` router (``mlp.gate`` / ``block_sparse_moe.gate``).
        router_bias: ``[E]`` float32 DeepSeek-V3 ``e_score_correction_bias``, or None.
        shared: qwen2_moe's shared expert or DeepSeek's shared experts, or None. It is
            part of every rank's non-expert weights (replicated, never placed).
        shared_gate: ``[1, H]`` qwen2_moe sigmoid gate of the shared expert, or None.
    """

    router: torch.Tensor
    router_bias: torch.Tensor | None = None
    shared: DenseMLPWeights | None = None
    shared_gate: torch.Tensor | None = None


def dense_mlp(x: torch.Tensor, w: DenseMLPWeights) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x [T, H]``."""
    if w.gate_up is not None:
        gate, up = linear(x, w.gate_up).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w.gate), linear(x, w.up)
    return linear(F.silu(gate) * up, w.down)


def moe_block(
    layer_idx: int,
    x: torch.Tensor,
    w: MoEBlockWeights,
    executor: ExpertExecutor,
    routing: RoutingConfig,
) -> torch.Tensor:
    """Routed experts (via ``executor``) plus the optional (sigmoid-gated) shared expert.

    Args:
        x: ``[T, H]`` normalised hidden states, model dtype.
        routing: the model's routing rule (:mod:`elasticep.models.routing`).

    Returns:
        ``[T, H]`` model dtype.
    """
    logits = router_logits(x, w.router, routing)
    rule = fused_rule(logits, routing)
    # an executor may route inside its own dispatch (ExecutorDefaults.route_and_run)
    out = None if rule is None else executor.route_and_run(layer_idx, x, logits, rule)
    if out is None:
        ids, weights = route_logits(logits, routing, x.dtype, w.router_bias)
        out = executor(layer_idx, x, ids, weights)
    if w.shared is not None:
        shared = dense_mlp(x, w.shared)
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, w.shared_gate)) * shared
        out = out + shared
    return out
