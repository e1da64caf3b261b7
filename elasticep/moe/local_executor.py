"""Single-rank expert executor: run routed tokens through the experts in local slots.

Implements the executor contract of docs/ARCHITECTURE.md ("MoE layer"):

    out = executor(layer_idx, hidden_states, topk_ids, topk_weights)

Expert weights live in *physical slots*; :class:`ExpertSlots` holds, per decoder layer,
``w13 [S, 2*I, H]`` (gate rows then up rows), ``w2 [S, H, I]`` and the row
``slot_to_logical[layer] [S]``. The expert compute itself is
:mod:`elasticep.moe.experts.expert_compute`, shared with the EP executors: grouped GEMM on CUDA
(no host sync), per-expert matmuls on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from elasticep.moe.exchange.pair_combine import combine_pairs
from elasticep.moe.executor import ExecutorDefaults
from elasticep.moe.experts.expert_compute import (
    grouped_ok,
    grouped_swiglu,
    run_expert_rows,
)


@dataclass
class ExpertSlots:
    """Expert weights of one rank, by physical slot.

    Attributes:
        w13: per decoder layer, ``[S, 2*I, H]`` (model dtype) or None for a dense layer.
        w2: per decoder layer, ``[S, H, I]`` or None for a dense layer.
        slot_to_logical: ``[L, S]`` int64, the logical expert each local slot holds.
            Rows of dense layers are ignored. Mutable: orphan reload rewrites a slot.
    """

    w13: list[torch.Tensor | None]
    w2: list[torch.Tensor | None]
    slot_to_logical: torch.Tensor

    @property
    def num_slots(self) -> int:
        """S, the number of physical slots per layer on this rank."""
        return int(self.slot_to_logical.shape[1])


def run_slots(
    w13: torch.Tensor,
    w2: torch.Tensor,
    hidden_states: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum of SwiGLU experts over local slots.

    Args:
        w13: ``[S, 2*I, H]`` gate rows then up rows.
        w2: ``[S, H, I]``.
        hidden_states: ``[T, H]`` model dtype.
        slot_ids: ``[T, k]`` int64 local slot per (token, choice), in ``[0, S)``.
        weights: ``[T, k]`` float32 combine weights.

    Returns:
        ``[T, H]`` model dtype: ``sum_j weights[t, j] * expert_{slot_ids[t, j]}(h_t)``,
        summed in float32 (:func:`~elasticep.moe.exchange.pair_combine.combine_pairs`).
    """
    (T, k), H = slot_ids.shape, hidden_states.shape[1]
    # row t*k + j: token t, choice j; then the weighted sum over k (no index_add_, whose
    # scatter kernel enters an OpenMP region per call: slow on a loaded CPU)
    rows = hidden_states.unsqueeze(1).expand(T, k, H).reshape(T * k, H)
    pair_out = run_expert_rows(w13, w2, rows, slot_ids.reshape(-1))
    return combine_pairs(pair_out, weights, hidden_states.dtype)


class LocalExpertExecutor(ExecutorDefaults):
    """The single-rank executor: every routed logical expert must have a local slot.

    Args:
        slots: this rank's expert weights.
        num_logical_experts: E, the router's output width.

    Raises:
        ValueError: from :meth:`__call__` when a token routes to an expert no slot holds.
    """

    def __init__(self, slots: ExpertSlots, num_logical_experts: int) -> None:
        self.slots = slots
        self.num_logical_experts = num_logical_experts
        self._logical_to_slot: torch.Tensor | None = None
        self._logical_to_tag: torch.Tensor | None = None
        self._complete = False  # every logical expert of every MoE layer has a slot
        self.graph_safe = False  # may run inside a CUDA graph (see refresh)
        self.version = 0  # bumped by refresh: a captured graph holds the old tables

    def refresh(self) -> None:
        """Rebuild the logical -> slot map after ``slots.slot_to_logical`` changed."""
        s2l = self.slots.slot_to_logical
        num_layers, num_slots = s2l.shape
        # one column more for id E, an empty slot's, dropped after
        l2s = torch.full((num_layers, self.num_logical_experts + 1), -1, dtype=torch.long)
        # The first slot that holds a logical expert serves it (replicas are for EP).
        for slot in reversed(range(num_slots)):
            l2s[torch.arange(num_layers), s2l[:, slot].cpu()] = slot
        l2s = l2s[:, :self.num_logical_experts].contiguous()
        moe = [i for i, w in enumerate(self.slots.w13) if w is not None]
        self._complete = bool((l2s[moe] >= 0).all()) if moe else True
        weights = self.slots.w13[moe[0]] if moe else None
        self._logical_to_slot = l2s.to(weights.device) if weights is not None else l2s
        # the expert kernels' tags (slot + 1, 0 = none): one gather a layer, no add
        self._logical_to_tag = self._logical_to_slot + 1
        # graph-safe = the grouped path, which neither syncs nor checks ids on the host
        self.graph_safe = self._complete and weights is not None and grouped_ok(
            weights[0, :0], weights)
        self.version += 1

    def __call__(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Apply the routed experts of ``layer_idx``; shapes as in :func:`run_slots`.

        On CUDA with bf16 weights and a complete placement this is one grouped GEMM pair
        and no host sync (the missing-expert check is done once, in :meth:`refresh`).
        """
        if self._logical_to_slot is None:
            self.refresh()
        w13, w2 = self.slots.w13[layer_idx], self.slots.w2[layer_idx]
        if self._complete and grouped_ok(hidden_states, w13):
            # pair t*k + j: token t, choice j; the kernels read token t's row for it
            # (prefill-sized batches) or expand it without a host sync
            tags = self._logical_to_tag[layer_idx][topk_ids].reshape(-1)
            pair_out = grouped_swiglu(w13, w2, hidden_states, tags, use_grouped=True,
                                      row_repeat=topk_ids.shape[1])
            return combine_pairs(pair_out, topk_weights, hidden_states.dtype)
        slot_ids = self._logical_to_slot[layer_idx][topk_ids]
        if bool((slot_ids < 0).any()):
            missing = sorted(set(topk_ids[slot_ids < 0].tolist()))
            raise ValueError(f"layer {layer_idx}: logical experts {missing} have no local slot")
        return run_slots(w13, w2, hidden_states, slot_ids, topk_weights)
