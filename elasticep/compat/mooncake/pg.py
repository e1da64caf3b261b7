"""Mooncake PG's public Python API (``mooncake.pg``) on the elastic backend.

Importing this module registers the torch.distributed backends "mooncake-cpu" (CPU
tensors) and "mooncake" (CPU and CUDA tensors). Ranks start as Mooncake's do::

    dist.init_process_group(backend="mooncake-cpu", rank=r, world_size=n,
                            pg_options=pg.MooncakeBackendOptions(max_group_size))

with MASTER_ADDR / MASTER_PORT set (``env://``); the coordinator is started detached by
the first rank (`launch`). Every call taking ``backend`` takes the group object
torch returned (``dist.group.WORLD`` or a ``new_group`` result).

Membership calls block until the coordinator has committed the change; responses
report ``status`` (`ProposalStatus`), ``new_epoch``, ``dropped_ranks`` and
``reject_reason``. Settings calls hold for groups created after them:
``set_collective_timeout_us`` / ``set_p2p_timeout_us`` bound every blocking wait (the
elastic backend has one op timeout), ``set_host_ip`` is the interface the coordinator
binds. ``set_fault_reconciliation_window_us``, ``set_device_filter`` and
``set_transfer_engine`` are accepted and do nothing: failures are detected through
the control connection at once, and data moves over Gloo / NCCL, not RDMA devices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from elasticep.distributed import api
from elasticep.membership.transitions import SlotState

from .backend import SETTINGS, MooncakeBackendOptions, MooncakeProcessGroup, create_backend

__all__ = [
    "MooncakeBackendOptions", "ProposalStatus", "ProposeViewUpdateResponse",
    "SyncAfterFailureResponse", "SyncAfterFailureStatus", "ViewUpdateStatus",
    "activate_ranks", "createMooncakeBackend", "createMooncakeCpuBackend",
    "deactivate_ranks", "extend_group_size_to", "get_active_ranks", "get_current_epoch",
    "get_failed_ranks_hint", "get_local_success", "get_num_synced_ranks", "get_peer_state",
    "join_group", "recover_ranks", "set_collective_timeout_us",
    "set_device_filter", "set_fault_reconciliation_window_us", "set_host_ip",
    "set_p2p_timeout_us", "set_transfer_engine", "sync_after_failure",
]


class ProposalStatus(enum.IntEnum):
    """Outcome of a membership proposal (`recover_ranks`, `deactivate_ranks`)."""

    Rejected = 0
    Applied = 1
    AppliedWithDroppedRanks = 2


ViewUpdateStatus = ProposalStatus  # Mooncake's older name


class SyncAfterFailureStatus(enum.IntEnum):
    """Outcome of `sync_after_failure`."""

    Reconciled = 0
    NoPending = 1
    Rejected = 2


@dataclass(frozen=True)
class ProposeViewUpdateResponse:
    """status; new_epoch (the group's epoch after the call); dropped_ranks (requested
    ranks left out); reject_reason ("" unless Rejected)."""

    status: ProposalStatus
    new_epoch: int
    dropped_ranks: list[int] = field(default_factory=list)
    reject_reason: str = ""


@dataclass(frozen=True)
class SyncAfterFailureResponse:
    status: SyncAfterFailureStatus
    reject_reason: str = ""


def createMooncakeBackend(dopts, options=None) -> MooncakeProcessGroup:  # noqa: N802
    """Backend creator of "mooncake" (Mooncake's name)."""
    return create_backend(dopts, options, "mooncake")


def createMooncakeCpuBackend(dopts, options=None) -> MooncakeProcessGroup:  # noqa: N802
    """Backend creator of "mooncake-cpu" (Mooncake's name)."""
    return create_backend(dopts, options, "mooncake-cpu")


def _group(backend) -> MooncakeProcessGroup:
    pg = backend if backend is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, MooncakeProcessGroup):
        raise ValueError(f"{pg!r} is not a group of the mooncake backend")
    return pg


# ------------------------------------------------------------------ per-op results
def get_local_success(work) -> bool:
    """True iff the op reached every rank of the group's view (False for other Works)."""
    return bool(getattr(work, "local_success", False))


def get_failed_ranks_hint(work) -> torch.Tensor:
    """int32 [max_group_size]: 1 for each rank the op lost (empty for other Works)."""
    hint = getattr(work, "failed_ranks_hint", None)
    if hint is None:
        return torch.empty(0, dtype=torch.int32)
    if not getattr(work, "is_completed", lambda: True)():
        work.wait()
    return hint()


# ------------------------------------------------------------------ membership
def get_active_ranks(backend) -> torch.Tensor:
    """int32 [max_group_size]: 1 for each rank of the group's view."""
    g = _group(backend)
    mask = torch.zeros(len(g.gs.ranks), dtype=torch.int32)
    mask[g.view()] = 1
    return mask


def get_num_synced_ranks(backend) -> int:
    """Number of ranks in the group's view."""
    return len(_group(backend).view())


def get_current_epoch(backend) -> int:
    """The group's committed epoch (grows with every membership change)."""
    return _group(backend).gs.epoch


def get_peer_state(backend, ranks: list[int]) -> list[bool]:
    """Per rank: True when it is alive and ready to be activated, or active."""
    return api.get_peer_state(_group(backend), list(ranks))


def extend_group_size_to(backend, size: int) -> None:
    """Mooncake grows a group's rank space here; an elastic group's capacity is fixed
    at creation (max_group_size), so this only checks that `size` fits in it.

    Raises:
        ValueError: `size` exceeds the group's max_group_size.
    """
    g = _group(backend)
    if size > len(g.gs.ranks):
        raise ValueError(f"cannot extend the group to {size} ranks: its max_group_size is "
                         f"{len(g.gs.ranks)}, fixed when the group was created")


def recover_ranks(backend, ranks: list[int]) -> ProposeViewUpdateResponse:
    """Activate ready ranks (joiners or replacements); every active member calls it.

    Returns Applied when every listed rank is active, AppliedWithDroppedRanks when some
    were not ready, Rejected when none was.
    """
    g = _group(backend)
    ranks = [int(r) for r in ranks]
    if g._manual_view is not None:
        api.recover_ranks(g, [r for r in ranks if r not in g.gs.active])
        g.view_add(r for r in ranks if r in g.gs.active)
    else:
        api.recover_ranks(g, ranks)
    return _response(g, ranks, lambda r: r in g.view(), "not ready to be activated")


activate_ranks = recover_ranks  # a live rank that missed an epoch rejoins the same way


def deactivate_ranks(backend, ranks: list[int]) -> ProposeViewUpdateResponse:
    """Remove ranks from the group's view (planned, or a dead rank in manual mode); a
    rank may remove itself. Blocks until committed."""
    g = _group(backend)
    ranks = [int(r) for r in ranks]
    api.deactivate_ranks(g, ranks)
    g.view_remove(ranks)
    return _response(g, ranks, lambda r: r not in g.view(), "could not be removed")


def _response(g: MooncakeProcessGroup, ranks: list[int], done, why: str
              ) -> ProposeViewUpdateResponse:
    dropped = [r for r in ranks if not done(r)]
    if not dropped:
        return ProposeViewUpdateResponse(ProposalStatus.Applied, g.gs.epoch)
    if len(dropped) == len(ranks):
        return ProposeViewUpdateResponse(ProposalStatus.Rejected, g.gs.epoch, dropped,
                                         f"ranks {dropped} {why}")
    return ProposeViewUpdateResponse(ProposalStatus.AppliedWithDroppedRanks, g.gs.epoch,
                                     dropped)


def join_group(backend) -> None:
    """Extension rank: announce readiness and block until the members activate it."""
    g = _group(backend)
    api.join_group(g, SETTINGS["timeout_s"])
    g.view_add(g.gs.active)


def sync_after_failure(backend) -> SyncAfterFailureResponse:
    """Wait until the coordinator's decision on every failure seen so far is applied
    here. Reconciled if the committed membership lost ranks of the view, else NoPending;
    the view itself changes only through `deactivate_ranks` in manual mode."""
    g = _group(backend)
    gs = g.gs
    try:
        gs.wait_until(lambda: gs.pending is None and not any(
            gs.states[s] == SlotState.FAILED for s in gs.active), gs.timeout_s, "failure decision")
    except TimeoutError as e:
        return SyncAfterFailureResponse(SyncAfterFailureStatus.Rejected, str(e))
    lost = set(g.view()) - set(gs.active)
    return SyncAfterFailureResponse(SyncAfterFailureStatus.Reconciled if lost
                                    else SyncAfterFailureStatus.NoPending)


# ------------------------------------------------------------------ settings
def set_collective_timeout_us(us: int) -> None:
    """Bound of every blocking wait of groups created later (microseconds)."""
    SETTINGS["timeout_s"] = us / 1e6


set_p2p_timeout_us = set_collective_timeout_us  # one op timeout for both


def set_host_ip(host: str) -> None:
    """Interface the detached coordinator binds and advertises (default MASTER_ADDR)."""
    SETTINGS["host"] = host


def set_fault_reconciliation_window_us(us: int) -> None:
    """Accepted, no effect: a death is known when its control connection closes."""


def set_device_filter(filters: list[str]) -> None:
    """Accepted, no effect: data moves over Gloo / NCCL, not chosen RDMA devices."""


def set_transfer_engine(engine) -> None:
    """Accepted, no effect: there is no Mooncake transfer engine to share."""


for _name, _creator, _devices in (("mooncake-cpu", createMooncakeCpuBackend, ["cpu"]),
                                  ("mooncake", createMooncakeBackend, ["cpu", "cuda"])):
    if _name not in dist.Backend.backend_list:
        dist.Backend.register_backend(_name, _creator, extended_api=True, devices=_devices)
