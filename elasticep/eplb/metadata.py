"""ExpertLocationMetadata: the placement as the lookup tensors the MoE hot path needs.

Tensor names follow SGLang's design. Static dispatch sends a rank's tokens for expert e
to the *nearest* replica: one on the rank itself (its lowest slot), else the replica
whose rank is the smallest forward ring distance ``(owner - ep_rank) % max_ep_size``
away (lowest slot on that rank). Forward ring distance is deterministic and makes
different ranks prefer different replicas, which spreads the load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticep.eplb.placement import Placement


@dataclass
class ExpertLocationMetadata:
    """Where every logical expert lives, for one EP rank.

    Attributes:
        placement: the placement these tensors were derived from (CPU).
        ep_rank: the rank whose static dispatch map this is.
        physical_to_logical_map: [L, P] int64 on ``device``; EMPTY slots hold
            ``num_logical_experts`` (see :mod:`elasticep.eplb.placement`).
        physical_to_logical_map_cpu: the same on CPU.
        logical_to_all_physical_map: [L, E, X] int64, each expert's slots ascending,
            padded with -1; X is at least :meth:`Placement.replica_width`, so a change of
            membership keeps this shape (and the CUDA graphs that read it).
        logical_to_all_physical_map_num_valid: [L, E] int64, the valid entries per row.
        logical_to_rank_dispatch_physical_map: [L, E] int64, the slot ``ep_rank`` sends
            each expert's tokens to under static dispatch.
        *_cpu: CPU copies used by the CPU dispatch path, so it never syncs a device.
    """

    placement: Placement
    ep_rank: int
    physical_to_logical_map: torch.Tensor
    physical_to_logical_map_cpu: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_to_all_physical_map_cpu: torch.Tensor
    logical_to_all_physical_map_num_valid: torch.Tensor
    logical_to_all_physical_map_num_valid_cpu: torch.Tensor
    logical_to_rank_dispatch_physical_map: torch.Tensor
    logical_to_rank_dispatch_physical_map_cpu: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.placement.num_layers

    @property
    def num_logical_experts(self) -> int:
        return self.placement.num_logical_experts

    @property
    def num_physical_experts(self) -> int:
        return self.placement.num_slots

    @property
    def num_local_physical_experts(self) -> int:
        return self.placement.slots_per_rank

    @property
    def max_ep_size(self) -> int:
        return self.placement.max_ep_size

    @property
    def active_ranks(self) -> torch.Tensor:
        """[max_ep_size] bool CPU."""
        return self.placement.active_ranks

    @classmethod
    def from_placement(
        cls, placement: Placement, ep_rank: int, device: torch.device | str = "cpu"
    ) -> ExpertLocationMetadata:
        """Derive every lookup tensor from a placement.

        Args:
            placement: where the experts live.
            ep_rank: this rank (need not be active: it then sends to remote replicas).
            device: where the non-CPU copies live.

        Raises:
            ValueError: if ``ep_rank`` is out of range or an expert has no slot.
        """
        if not 0 <= ep_rank < placement.max_ep_size:
            raise ValueError(f"ep_rank {ep_rank} outside [0, {placement.max_ep_size})")
        log2phy, num_valid = placement.log2phy(placement.replica_width())
        if bool((num_valid == 0).any()):
            layer, expert = (int(x) for x in torch.nonzero(num_valid == 0)[0])
            raise ValueError(f"layer {layer}: logical expert {expert} has no slot")
        dispatch = compute_rank_dispatch_map(log2phy, placement.slots_per_rank, placement.max_ep_size, ep_rank)
        dev = torch.device(device)
        return cls(
            placement=placement,
            ep_rank=ep_rank,
            physical_to_logical_map=placement.phy2log.to(dev),
            physical_to_logical_map_cpu=placement.phy2log,
            logical_to_all_physical_map=log2phy.to(dev),
            logical_to_all_physical_map_cpu=log2phy,
            logical_to_all_physical_map_num_valid=num_valid.to(dev),
            logical_to_all_physical_map_num_valid_cpu=num_valid,
            logical_to_rank_dispatch_physical_map=dispatch.to(dev),
            logical_to_rank_dispatch_physical_map_cpu=dispatch,
        )

    def logical_to_all_physical(self, layer: int, expert: int) -> list[int]:
        """The slots of one expert, ascending."""
        n = int(self.logical_to_all_physical_map_num_valid_cpu[layer, expert])
        return self.logical_to_all_physical_map_cpu[layer, expert, :n].tolist()


def compute_rank_dispatch_map(
    log2phy: torch.Tensor, slots_per_rank: int, max_ep_size: int, ep_rank: int
) -> torch.Tensor:
    """Static dispatch: the nearest replica of every expert as seen from ``ep_rank``.

    Args:
        log2phy: [L, E, X] int64, slots per expert padded with -1 (at least one valid).
        slots_per_rank: slots per rank, so a slot's rank is ``slot // slots_per_rank``.
        max_ep_size: ring size for the distance.
        ep_rank: the sending rank.

    Returns:
        [L, E] int64 slot ids: minimal ``((slot // slots_per_rank - ep_rank) % max_ep_size,
        slot)`` over the valid slots.
    """
    valid = log2phy >= 0
    owner = torch.div(log2phy.clamp(min=0), slots_per_rank, rounding_mode="floor")
    distance = (owner - ep_rank) % max_ep_size
    # One sortable key per candidate; padding gets a key larger than any real one.
    key = distance * (slots_per_rank * max_ep_size) + log2phy
    key = torch.where(valid, key, torch.iinfo(torch.int64).max)
    best = torch.argmin(key, dim=-1, keepdim=True)
    return log2phy.gather(-1, best).squeeze(-1)


def broadcast_global_expert_location_metadata(
    metadata: ExpertLocationMetadata | None,
    src_rank: int,
    group: dist.ProcessGroup | None,
    ep_rank: int,
    device: torch.device | str = "cpu",
) -> ExpertLocationMetadata:
    """Copy the placement from a healthy rank to every member of ``group``.

    Sends a small int64 header (layers, experts, slots per rank, max_ep_size), then one
    buffer with ``phy2log`` and the active mask; each receiver derives the other tensors (its own
    static dispatch map included) locally, so stale receivers of any shape are fine.
    Works over any torch.distributed group that implements ``broadcast`` (Gloo/NCCL
    tensors are staged on CPU; use a Gloo or elastic CPU group).

    Args:
        metadata: the source's metadata (ignored on other ranks; may be None there).
        src_rank: the source's rank within ``group``; pick a healthy one (not 0 by default).
        group: the process group; None is the default group.
        ep_rank: this rank's EP rank, for its static dispatch map.
        device: where the derived device tensors go.

    Returns:
        The metadata every rank now shares.

    Raises:
        ValueError: if the source has no metadata.
    """
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    header = torch.zeros(4, dtype=torch.int64)
    if me == src_rank:
        if metadata is None:
            raise ValueError("the broadcast source needs metadata")
        p = metadata.placement
        header = torch.tensor([p.num_layers, p.num_logical_experts, p.slots_per_rank, p.max_ep_size])
    dist.broadcast(header, group=group, group_src=src_rank)
    L, E, S, M = (int(x) for x in header)
    # One buffer: phy2log row-major, then the active mask as 0/1.
    if me == src_rank:
        p = metadata.placement
        body = torch.cat([p.phy2log.flatten(), p.active_ranks.to(torch.int64)])
    else:
        body = torch.empty(L * S * M + M, dtype=torch.int64)
    dist.broadcast(body, group=group, group_src=src_rank)
    phy2log, mask = body[: L * S * M].view(L, S * M).clone(), body[L * S * M :].clone()
    placement = Placement(phy2log, E, S, mask.to(torch.bool))
    return ExpertLocationMetadata.from_placement(placement, ep_rank, device)
