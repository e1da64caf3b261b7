"""SGLang-style parallel state over elastic groups (the seeds' contract, tested directly).

* `GroupCoordinator(group_ranks, local_rank, backend, group_name, recovered_rank=False,
  rank_offset=0, max_world_size=None)`: builds one group per entry of `group_ranks`
  (cohort-local rank lists shifted by `rank_offset` into global ranks) and keeps the one
  containing this rank.
* `use_local_synchronization = rank_offset > 0 and not recovered_rank`: a scale cohort
  builds its own groups among itself only; everybody else builds every group in the same
  global order (torch's group naming depends on it).
* Only a group given `max_world_size` (WORLD) reserves capacity for appended ranks;
  model-parallel groups are fixed to their launch cohort.
* `is_extension` of a group: a recovered rank rejoins every group; WORLD is also joined
  by a scale cohort (rank_offset > 0).
* With the CPU "elastic" backend the cpu_group *is* the device_group (one group, one
  mask); with another device backend the cpu_group is an elastic group of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from elasticep.distributed import api

_GROUPS: dict[str, GroupCoordinator] = {}
_NAME_COUNT: dict[str, int] = {}
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_MOE_EP: GroupCoordinator | None = None
_MOE_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None


def _unique_name(name: str) -> str:
    n = _NAME_COUNT.get(name, 0)
    _NAME_COUNT[name] = n + 1
    return f"{name}:{n}"


class GroupCoordinator:
    """One kind of parallel group (e.g. "tp") as seen by this rank.

    Attributes:
        ranks: global ranks of this rank's group (for WORLD: every capacity slot);
        rank_in_group: our index in it; world_size: len(ranks);
        device_group / cpu_group: the torch groups; active_ranks / active_ranks_cpu:
        int32 [group capacity] masks kept current by the backend (None if not elastic);
        use_local_synchronization / max_group_size / is_extension: how it was built.
    """

    def __init__(self, group_ranks: list[list[int]], local_rank: int, backend: str,
                 group_name: str, recovered_rank: bool = False, rank_offset: int = 0,
                 max_world_size: int | None = None, *,
                 is_extension: bool | None = None) -> None:
        self.unique_name = _unique_name(group_name)
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.recovered_rank, self.rank_offset = recovered_rank, rank_offset
        self.use_local_synchronization = rank_offset > 0 and not recovered_rank
        self.max_group_size = max_world_size
        if is_extension is None:
            is_extension = recovered_rank or (max_world_size is not None and rank_offset > 0)
        self.is_extension = is_extension
        elastic = backend == "elastic"
        self.device_group = self.cpu_group = None
        self.active_ranks = self.active_ranks_cpu = None
        self.ranks: list[int] = []
        for i, local in enumerate(group_ranks):
            launch = [r + rank_offset for r in local]
            # A group with capacity spans its reserved slots too (they map to the global
            # ranks after the launch ranks), so a joiner is a torch member of it.
            ranks = launch + [max(launch) + 1 + j
                              for j in range((max_world_size or 0) - len(launch))]
            member = self.rank in ranks
            if self.use_local_synchronization and not member:
                continue  # local synchronization: only members build the group
            size = max_world_size or len(ranks)
            mask = torch.zeros(size, dtype=torch.int32)
            mask[:len(launch)] = 1
            kwargs = {"backend": backend,
                      "use_local_synchronization": self.use_local_synchronization}
            if elastic:
                kwargs["pg_options"] = api.BackendOptions(
                    mask, self.is_extension, max_world_size,
                    unique_name=f"{self.unique_name}/{i}")
            group = dist.new_group(ranks, **kwargs)
            cpu_group, cpu_mask = group, mask
            if not elastic:
                cpu_mask = mask.clone()
                cpu_group = dist.new_group(
                    ranks, backend="elastic",
                    pg_options=api.BackendOptions(cpu_mask, self.is_extension, max_world_size,
                                                  unique_name=f"{self.unique_name}/{i}/cpu"),
                    use_local_synchronization=self.use_local_synchronization)
            if member:
                self.ranks, self.device_group, self.cpu_group = ranks, group, cpu_group
                self.active_ranks = mask if elastic else None
                self.active_ranks_cpu = cpu_mask
        self.rank_in_group = self.ranks.index(self.rank) if self.ranks else -1
        self.world_size = len(self.ranks)
        _GROUPS[self.unique_name] = self

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.unique_name}, ranks={self.ranks}, "
                f"local_sync={self.use_local_synchronization}, max={self.max_group_size})")


def init_world_group(ranks: list[int], local_rank: int, backend: str,
                     recovered_rank: bool = False,
                     max_world_size: int | None = None) -> GroupCoordinator:
    """WORLD: the only group with capacity (`max_world_size`) for appended ranks.

    A scale joiner (its global rank >= len(ranks)) builds it as an extension.
    """
    global _WORLD
    joiner = dist.get_rank() >= len(ranks) and not recovered_rank
    _WORLD = GroupCoordinator([list(ranks)], local_rank, backend, "world", recovered_rank,
                              0, max_world_size,
                              is_extension=recovered_rank or (joiner and bool(max_world_size)))
    return _WORLD


def initialize_model_parallel(tensor_model_parallel_size: int,
                              expert_model_parallel_size: int,
                              pipeline_model_parallel_size: int = 1,
                              recovered_rank: bool = False, rank_offset: int = 0,
                              max_world_size: int | None = None,
                              backend: str = "elastic",
                              cohort_size: int | None = None) -> None:
    """Build TP, MoE-EP, MoE-TP and PP groups of this rank's launch cohort.

    Args:
        tensor_model_parallel_size: TP size (ranks of a TP group are consecutive).
        expert_model_parallel_size: EP size inside each TP group (must divide TP).
        pipeline_model_parallel_size: must be 1 with elastic groups.
        recovered_rank / rank_offset: see GroupCoordinator.
        max_world_size: accepted for signature compatibility; model-parallel groups are
            never given it (only WORLD is extendable).
        backend: device backend; cohort_size: ranks in the cohort (default TP * PP).
    Raises:
        ValueError: sizes that do not divide.
    """
    global _TP, _MOE_EP, _MOE_TP, _PP
    tp, ep, pp = (tensor_model_parallel_size, expert_model_parallel_size,
                  pipeline_model_parallel_size)
    if backend == "elastic" and pp != 1:
        raise ValueError("elastic groups require pipeline_model_parallel_size == 1")
    if tp % ep:
        raise ValueError(f"expert parallel size {ep} must divide tensor parallel size {tp}")
    n = cohort_size or tp * pp
    moe_tp = tp // ep
    tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(n // tp)]
    ep_groups = [[g[0] + j + k * moe_tp for k in range(ep)] for g in tp_groups
                 for j in range(moe_tp)]
    moe_tp_groups = [[g[0] + k * moe_tp + j for j in range(moe_tp)] for g in tp_groups
                     for k in range(ep)]
    pp_groups = [list(range(i, n, n // pp)) for i in range(n // pp)]
    args = (0, backend)
    _TP = GroupCoordinator(tp_groups, *args, "tp", recovered_rank, rank_offset)
    _MOE_EP = GroupCoordinator(ep_groups, *args, "moe_ep", recovered_rank, rank_offset)
    _MOE_TP = GroupCoordinator(moe_tp_groups, *args, "moe_tp", recovered_rank, rank_offset)
    _PP = GroupCoordinator(pp_groups, *args, "pp", recovered_rank, rank_offset)


def get_world_group() -> GroupCoordinator | None:
    return _WORLD


def get_tp_group() -> GroupCoordinator | None:
    return _TP


def get_moe_ep_group() -> GroupCoordinator | None:
    return _MOE_EP


def iter_live_parallel_groups() -> Iterator[GroupCoordinator]:
    """Groups this rank belongs to, sorted by unique_name (the same order on every rank)."""
    for name in sorted(_GROUPS):
        gc = _GROUPS[name]
        if gc.device_group is not None:
            yield gc


def destroy_model_parallel() -> None:
    """Forget all GroupCoordinators (the torch groups stay alive)."""
    global _WORLD, _TP, _MOE_EP, _MOE_TP, _PP
    _GROUPS.clear()
    _NAME_COUNT.clear()
    _WORLD = _TP = _MOE_EP = _MOE_TP = _PP = None
