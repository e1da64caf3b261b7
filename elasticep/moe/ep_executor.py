"""The expert-parallel executor: dispatch, run local slots, combine.

Implements the executor contract of docs/ARCHITECTURE.md ("MoE layer"):

    out = executor(layer_idx, hidden_states, topk_ids, topk_weights)

over any torch.distributed group (plain Gloo, or the elastic group whose ``size()`` is
``max_ep_size`` with holes). Every active rank must call it for every MoE layer of
every step, with T = 0 when it has no tokens, because it still hosts experts.
Placement layers are decoder layers; the weights of dense layers are None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elasticep.config import DispatchAlgorithm
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.eplb.placement import Placement
from elasticep.moe.exchange.uneven_exchange import (
    choose_physical_slots,
    uneven_combine,
    uneven_dispatch,
)
from elasticep.moe.executor import ExecutorDefaults
from elasticep.moe.experts.expert_compute import run_expert_rows
from elasticep.moe.peer_weights import PeerWeights


class EPMoEExecutor(ExecutorDefaults):
    """Expert executor over an EP group: holds this rank's slots and the metadata.

    Args:
        metadata: expert locations for this rank (``metadata.ep_rank`` is this rank's
            index in ``group``).
        w13: per decoder layer, [slots_per_rank, 2*I, H] in model dtype, or None for a
            dense layer; slot j holds expert ``metadata.placement.local(rank)[layer, j]``.
        w2: per decoder layer, [slots_per_rank, H, I] or None.
        group: the EP process group (a Gloo or elastic CPU group).
        dispatch_algorithm: ``"static"`` (nearest replica) or ``"dynamic"`` (spread).

    Raises:
        ValueError: if the weights do not match the placement, or the group's size is
            not ``max_ep_size``.
    """

    def __init__(
        self,
        metadata: ExpertLocationMetadata,
        w13: list[torch.Tensor | None],
        w2: list[torch.Tensor | None],
        group: dist.ProcessGroup | None,
        dispatch_algorithm: DispatchAlgorithm = DispatchAlgorithm.STATIC,
    ) -> None:
        if dispatch_algorithm not in ("static", "dynamic"):
            raise ValueError(f"unknown dispatch algorithm {dispatch_algorithm!r}")
        # Splits are indexed by rank id, so the group must span all rank ids (an
        # elastic group reports size() == max_ep_size and marks holes inactive).
        size = dist.get_world_size(group) if dist.is_initialized() else None
        if size is not None and size != metadata.max_ep_size:
            raise ValueError(f"group size {size} != max_ep_size {metadata.max_ep_size}")
        self.group = group
        self.dispatch_algorithm = dispatch_algorithm
        # other ranks' expert tensors, mapped (ranks of one host with the cuda_ipc
        # transport): placement changes (elastic.placement_sync) then copy device to
        # device, and this rank publishes its tensors again after each change
        self.peer_weights: PeerWeights | None = None
        self.set_placement(metadata, w13, w2)

    @property
    def rank(self) -> int:
        return self.metadata.ep_rank

    @property
    def placement(self) -> Placement:
        return self.metadata.placement

    def slot_to_logical(self) -> torch.Tensor:
        """[L, slots_per_rank] int64, the expert in each local slot (EMPTY = E)."""
        return self.placement.local(self.rank)

    def set_placement(
        self, metadata: ExpertLocationMetadata, w13: list[torch.Tensor | None], w2: list[torch.Tensor | None]
    ) -> None:
        """Swap in new metadata and matching local weights (after a placement change).

        Raises:
            ValueError: if the lists or slot counts do not match the placement.
        """
        L, S = metadata.num_layers, metadata.num_local_physical_experts
        if len(w13) != L or len(w2) != L:
            raise ValueError(f"need {L} layers of weights, got {len(w13)} / {len(w2)}")
        for layer, (a, b) in enumerate(zip(w13, w2, strict=True)):
            if (a is None) != (b is None):
                raise ValueError(f"layer {layer}: w13 and w2 must both be set or both None")
            if a is not None and (a.shape[0] != S or b.shape[0] != S):
                raise ValueError(f"layer {layer}: {a.shape[0]} / {b.shape[0]} local slots, want {S}")
        self.metadata, self.w13, self.w2 = metadata, list(w13), list(w2)

    def __call__(self, layer_idx: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """Route ``hidden_states`` through the experts of all ranks.

        Args:
            layer_idx: decoder layer index (an MoE layer).
            hidden_states: [T, H] model dtype (CPU).
            topk_ids: [T, k] int64 logical expert ids.
            topk_weights: [T, k] float32 combine weights.

        Returns:
            [T, H] in the dtype of ``hidden_states``:
            ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(h_t)``.

        Raises:
            ValueError: on mismatched shapes, a dense layer, or out-of-range ids.
        """
        w13, w2 = self.w13[layer_idx], self.w2[layer_idx]
        if w13 is None or w2 is None:
            raise ValueError(f"layer {layer_idx} has no experts")
        T, k = topk_ids.shape
        if hidden_states.shape[0] != T or topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"shapes: hidden {tuple(hidden_states.shape)}, ids {tuple(topk_ids.shape)}, "
                f"weights {tuple(topk_weights.shape)}"
            )
        E = self.metadata.num_logical_experts
        if T and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= E):
            raise ValueError(f"topk_ids outside [0, {E})")
        slots = choose_physical_slots(self.metadata, layer_idx, topk_ids, self.dispatch_algorithm)
        rows, local, handle = uneven_dispatch(
            hidden_states, slots, self.metadata.num_local_physical_experts, self.metadata.max_ep_size, self.group
        )
        expert_out = run_expert_rows(w13, w2, rows, local)
        return uneven_combine(expert_out, handle, topk_weights, self.group)
