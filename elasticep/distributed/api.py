"""Mooncake-style public API of the elastic backend (see the package docstring).

Process-wide state: one control connection (`RankControl`) and one client of the
coordinator's TCPStore, created by `init_process_group`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticep.membership.messages import Deactivate, Ready, Recover, Register
from elasticep.membership.protocol import parse_address
from elasticep.membership.transitions import ACTIVE_STATES, OnFailure, SlotState

from .control import STALL_GRACE_S, RankControl
from .process_group import ElasticProcessGroup
from .state import GroupState

DEFAULT_TIMEOUT_S = float(os.environ.get("ELASTICEP_DIST_TIMEOUT_S", "60"))
_ctl: RankControl | None = None
_store: dist.Store | None = None
_timeout_s = DEFAULT_TIMEOUT_S


@dataclass
class BackendOptions:
    """Options of an elastic group (pass as `pg_options=` to new_group).

    Args:
        active_ranks: caller-owned int32 tensor [max_group_size]; its initial nonzero
            entries are the initially active slots, and the backend keeps it equal to
            the committed active mask. None: all `len(ranks)` slots active.
        is_extension: this rank joins an existing group (call `join_group` next).
        max_group_size: capacity in slots (default len(ranks)); slots past len(ranks)
            map to the global ranks following max(ranks), unless `global_ranks` says.
        on_failure: "complete" (finish reductions/barrier/broadcast over survivors) or
            "raise" (RankFailureError unless a survivor already completed the op).
        unique_name: stable group name shared by all members (default: torch's name).
        global_ranks: global rank of every slot (length max_group_size); -1 marks a
            reserved slot that is bound to whichever global rank first joins it (its
            joiner lists its own global rank at that slot).
    """

    active_ranks: torch.Tensor | None = None
    is_extension: bool = False
    max_group_size: int | None = None
    on_failure: OnFailure = OnFailure.COMPLETE
    unique_name: str | None = None
    global_ranks: list[int] | None = None

    def __init__(self, active_ranks: torch.Tensor | None = None, is_extension: bool = False,
                 max_group_size: int | None = None, *,
                 on_failure: OnFailure | str = OnFailure.COMPLETE,
                 unique_name: str | None = None, global_ranks: list[int] | None = None) -> None:
        if on_failure not in tuple(OnFailure):
            raise ValueError(f"on_failure must be 'complete' or 'raise', got {on_failure!r}")
        if active_ranks is not None and active_ranks.dtype != torch.int32:
            raise ValueError("active_ranks must be an int32 tensor")
        self.active_ranks, self.is_extension = active_ranks, is_extension
        self.max_group_size, self.on_failure, self.unique_name = (
            max_group_size, OnFailure(on_failure), unique_name)
        self.global_ranks = None if global_ranks is None else [int(r) for r in global_ranks]


def connect(coordinator: str, rank: int, max_world_size: int, *, world_size: int | None = None,
            is_extension: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
            stall_grace_s: float = STALL_GRACE_S, membership_store: str | None = None) -> None:
    """Open this process's control connection to the coordinator, or keep the open one.

    A process holds one connection for life: a second call (WORLD destroyed and
    initialised again) reuses it, so the coordinator does not see the slot taken twice.

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        rank: global slot of this process, in [0, max_world_size).
        max_world_size: capacity of WORLD.
        world_size: initially active slots (default max_world_size).
        is_extension: this process (re)joins an existing deployment.
        timeout_s: bound of every blocking call (seconds).
        stall_grace_s: longest wait on a stalled coordinator (seconds; see
            :func:`elasticep.distributed.control.stall_grace_s`).
        membership_store: ``etcd://...`` of a deployment with standby coordinators: a
            lost coordinator is then a leader change, found through etcd, and this
            process resumes with the new leader (``control.py``). None: it is lost.
    Raises:
        ValueError: refused by the coordinator, or this process already holds another
            rank or coordinator.
        TimeoutError: coordinator unreachable.
    """
    global _ctl, _store, _timeout_s
    _timeout_s = timeout_s
    if _ctl is not None and not _ctl.lost and not _ctl.evicted:
        if (_ctl.rank, _ctl.address) != (rank, coordinator):
            raise ValueError(f"this process is already rank {_ctl.rank} of the coordinator at "
                             f"{_ctl.address}; it cannot become rank {rank} of {coordinator}")
        return
    _ctl = RankControl(coordinator, rank, world_size or max_world_size, max_world_size,
                       is_extension, timeout_s, stall_grace_s, membership_store)
    _store = _new_store()
    _ctl.on_resumed.append(_follow_leader)


def _follow_leader() -> None:
    """After a leader change: groups registered from now on use the new leader's store."""
    global _store
    _store = _new_store()


def add_leader_listener(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after each coordinator leader change this process resumed through
    (``--membership-store etcd://...``), once :func:`store_client` names the new
    leader's store. It runs on the control thread: it must be quick (mark, not move).

    Raises:
        RuntimeError: no control connection yet (:func:`connect`).
    """
    if _ctl is None:
        raise RuntimeError("call elasticep.distributed.init_process_group first")
    _ctl.on_resumed.append(fn)


def control_address() -> str | None:
    """Coordinator address of this process's live control connection (None: none yet)."""
    if _ctl is None or _ctl.lost or _ctl.evicted:
        return None
    return _ctl.address


def init_process_group(coordinator: str, rank: int, world_size: int, *,
                       max_world_size: int | None = None, is_extension: bool = False,
                       timeout_s: float = DEFAULT_TIMEOUT_S,
                       on_failure: OnFailure | str = OnFailure.COMPLETE,
                       stall_grace_s: float = STALL_GRACE_S,
                       membership_store: str | None = None) -> ElasticProcessGroup:
    """Connect to the coordinator and make the "elastic" WORLD group the default group.

    May be called again after ``torch.distributed.destroy_process_group()`` in the same
    process: the control connection is kept and WORLD is registered afresh.

    Args:
        coordinator: ``"host:port"`` of the coordinator.
        rank: global slot of this process, in [0, max_world_size).
        world_size: number of initially active slots (0..world_size-1).
        max_world_size: capacity of WORLD (default world_size); `size()` reports it.
        is_extension: this process (re)joins an existing deployment; call
            `join_group(WORLD)` when ready to be admitted.
        timeout_s: bound of every blocking call (seconds).
        on_failure: failure mode of WORLD ("complete" or "raise").
        stall_grace_s, membership_store: as :func:`connect`.
    Returns:
        The default group (also available as torch.distributed.group.WORLD).
    Raises:
        ValueError: refused by the coordinator (slot already active, bad rank, ...).
        TimeoutError: coordinator unreachable.
    """
    mws = max_world_size or world_size
    connect(coordinator, rank, mws, world_size=world_size, is_extension=is_extension,
            timeout_s=timeout_s, stall_grace_s=stall_grace_s,
            membership_store=membership_store)
    mask = torch.zeros(mws, dtype=torch.int32)
    mask[:world_size] = 1
    opts = BackendOptions(mask, is_extension, mws, on_failure=on_failure, unique_name="world")
    dist.init_process_group("elastic", store=_store, rank=rank, world_size=mws,
                            pg_options=opts, timeout=timedelta(seconds=timeout_s))
    return dist.distributed_c10d._get_default_group()


def _new_store() -> dist.Store:
    """A fresh client connection to the coordinator's TCPStore."""
    host, _ = parse_address(_ctl.address)
    return dist.TCPStore(host, _ctl.store_port, is_master=False,
                         timeout=timedelta(seconds=_timeout_s))


# group name -> times this process shut a group of that name down: a group created again
# under the same name (WORLD destroyed and re-initialised) is a new group for the
# coordinator and gets fresh store keys, so its rendezvous never reads the old ones.
_incarnations: dict[str, int] = {}


def register_group(dopts, options: BackendOptions | None) -> GroupState:
    """Register this rank in the group torch is creating and return its state.

    Args:
        dopts: torch's ``_DistributedBackendOptions`` (group_id, group_size,
            global_ranks_in_group).
        options: the group's BackendOptions (None: defaults).
    Raises:
        RuntimeError: no control connection yet (`connect` / `init_process_group`).
        ValueError: inconsistent options, or refused by the coordinator.
    """
    if _ctl is None or _store is None:
        raise RuntimeError("call elasticep.distributed.init_process_group before new_group")
    options = options or BackendOptions()
    # The default group reports no ranks: it is the identity over its size.
    ranks = list(dopts.global_ranks_in_group) or list(range(dopts.group_size))
    given = len(ranks) if dopts.global_ranks_in_group else options.max_group_size or len(ranks)
    size = options.max_group_size or len(ranks)
    if options.global_ranks is not None:
        if len(options.global_ranks) != size:
            raise ValueError(f"global_ranks has {len(options.global_ranks)} entries, group "
                             f"size is {size}")
        ranks = list(options.global_ranks)
    else:
        ranks += [max(ranks) + 1 + i for i in range(size - len(ranks))]
    mask = options.active_ranks
    if mask is None:
        mask = torch.zeros(size, dtype=torch.int32)
        mask[:given] = 1
    if mask.numel() != size:
        raise ValueError(f"active_ranks has {mask.numel()} entries, group size is {size}")
    base = options.unique_name or str(dopts.group_id)
    k = _incarnations.get(base, 0)
    name = f"{base}~{k}" if k else base
    active = [i for i in range(size) if int(mask[i]) != 0]
    reg = _ctl.request(Register(name, ranks, active, options.on_failure,
                                options.is_extension))
    gs = GroupState(_ctl, _store, name, reg["slot"], ranks, reg, mask, _timeout_s,
                    joining=options.is_extension, new_store=_new_store,
                    on_close=lambda: _incarnations.__setitem__(base, k + 1))
    _ctl.attach(name, gs, reg["epoch"])
    return gs


def _create_backend(dopts, options: BackendOptions | None) -> ElasticProcessGroup:
    """torch.distributed backend creator (extended API) for "elastic"."""
    gs = register_group(dopts, options)
    return ElasticProcessGroup(gs, gs.slot, len(gs.ranks))


def _gs(group) -> GroupState:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ElasticProcessGroup):
        raise ValueError(f"{pg!r} is not an elastic group")
    return pg.gs


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None) -> None:
    """``torch.distributed.all_to_all_single`` for a data path, minus its dispatch.

    For an elastic group in steady state (CUDA tensors, ``on_failure="raise"``, every
    slot active, no change announced) the op is launched on the epoch's NCCL
    communicator directly (`GroupState.fast_all_to_all`), skipping torch.distributed's
    Python wrapper, its C++ dispatch and the call back into the Python backend: about
    13 us of host time per op on an H200 host, which a launch-bound MoE step feels.
    Everything else, any other group included, goes to
    ``torch.distributed.all_to_all_single(output, input, ...)``. Either way the caller's
    current stream is ordered after the op and the host does not wait for it.

    Args:
        output, input: tensors split along dim0 over the group's slots (splits: rows per
            slot; None for even splits).
        group: the group (None: the default group).
    Raises:
        as ``torch.distributed.all_to_all_single`` on `group` (RankFailureError etc.).
    """
    pg = group if group is not None else dist.GroupMember.WORLD
    if isinstance(pg, ElasticProcessGroup):
        work = pg.gs.fast_all_to_all(output, input, output_split_sizes or [],
                                     input_split_sizes or [])
        if work is not None:
            work.wait()
            return
    dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def get_active_ranks(group=None) -> torch.Tensor:
    """int32 tensor [max_group_size]: 1 for slots active in the committed epoch. No I/O."""
    return _gs(group).mask


def add_change_listener(group, fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever :func:`has_pending_change` may have become true: a
    transition announced, or a failure decision received. It runs on the control
    thread with no lock held, so it must be quick and thread-safe (e.g. notify a
    condition); an exception it raises is logged and dropped.
    """
    _gs(group).change_listeners.append(fn)


def get_current_epoch(group=None) -> int:
    """The group's latest committed epoch (cheap, no collective, no I/O)."""
    return _gs(group).epoch


def has_pending_change(group=None) -> bool:
    """True if a transition is announced, or a failure decision awaits this rank's next op."""
    gs = _gs(group)
    return gs.pending is not None or gs.failure is not None


def store_client() -> dist.Store:
    """A fresh client of the coordinator's rendezvous TCPStore (after
    :func:`init_process_group`), e.g. to build a side group over the same store.

    Raises:
        RuntimeError: the process group is not initialised.
    """
    if _ctl is None:
        raise RuntimeError("call elasticep.distributed.init_process_group first")
    return _new_store()


def group_diagnostics(group=None) -> dict:
    """What benchmarks and logs read of an elastic group (no I/O).

    Returns:
        {"epoch": int, "fast_path": bool (the steady-state all_to_all path is armed),
         "counters": {"fast", "run", "solo", "lease_confirms": int} (ops by route since
         start; "solo": CPU ops of a one-member epoch, done in place, counted in "run"),
         "nccl_timings": {epoch: {...}} (seconds per NCCL communicator phase)}.
    """
    gs = _gs(group)
    return {"epoch": gs.epoch, "fast_path": gs._fast is not None,
            "counters": dict(gs.counters), "nccl_timings": gs.comms.nccl_timings()}


def get_peer_state(group, ranks: list[int]) -> list[bool]:
    """True where the slot is alive and ready to be admitted, or active. Non-blocking."""
    st = _gs(group).states
    return [st[r] == SlotState.READY or st[r] in ACTIVE_STATES for r in ranks]


def get_slot_states(group=None) -> list[str]:
    """Per-slot state strings (failed|joining|ready|healthy|draining|removed). No I/O."""
    return list(_gs(group).states)


def get_pending_requests(group=None) -> dict[str, list[int]]:
    """Supervisor requests not applied yet: {"admit": [...], "remove": [...]}. No I/O."""
    return {k: list(v) for k, v in _gs(group).requests.items()}


def removal_known(requests: dict[str, list[int]], active: tuple[int, ...] | list[int],
                  slot: int) -> bool:
    """Whether a process's copy of the coordinator's state (its pending ``requests`` and
    committed ``active`` slots) knows of a removal of ``slot``: requested (``remove``,
    or ``keep``, which the coordinator sets before the request), or committed (pure)."""
    return (slot in requests.get("remove", ()) or slot in requests.get("keep", ())
            or slot not in active)


def wait_removal_known(group, slot: int, timeout_s: float) -> bool:
    """Block until this process's copy of the coordinator's state has caught up with a
    removal of ``slot`` that a step header announced: the removal request pushed here
    (with its ``keep`` list, which the coordinator sets first), or the removal committed.
    A step header carries what the first member read of its own copy; this process's
    pushes may still be on the way, and a removed rank reads whether to stay up from
    its own copy.

    Returns:
        True once known; False after ``timeout_s`` seconds (the copy stays as it is).

    Raises:
        RankEvictedError / CoordinatorLostError: as the group's waits.
    """
    gs = _gs(group)
    try:
        gs.wait_until(lambda: removal_known(gs.requests, gs.active, slot), timeout_s,
                      f"the removal request of slot {slot}")
    except TimeoutError:
        return False
    return True


def recover_ranks(group, ranks: list[int], timeout_s: float | None = None) -> list[int]:
    """Admit the given ready slots into the next epoch; returns the slots admitted.

    Every active member calls it with the same list (possibly at different steps): the
    first call starts the transition, ops with seq < boundary finish in the old epoch,
    and every member (and the joiner) runs ops >= boundary in the new one. Blocks until
    every listed slot that is ready (or already admitted) is active or has failed;
    slots still joining are skipped. Engine recipe: MAX-all_reduce a per-slot "ready"
    mask in the step header, then all call recover_ranks with exactly that list at the
    same step boundary; the joiner's first op is the next op.

    Raises:
        TimeoutError: not committed within timeout_s; RankEvictedError.
    """
    gs = _gs(group)
    admitting = gs.ctl.request(Recover(gs.name, list(ranks)))["admitting"]
    gs.wait_until(lambda: all(r in gs.active or gs.states[r] == SlotState.FAILED
                              for r in admitting),
                  timeout_s or _timeout_s, f"admission of {admitting}")
    return [r for r in admitting if r in gs.active]


def join_group(group=None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Extension rank: announce readiness and block until admitted.

    Raises:
        TimeoutError: not admitted within timeout_s.
    """
    gs = _gs(group)
    gs.ctl.request(Ready(gs.name))
    gs.join(timeout_s)


def deactivate_ranks(group, ranks: list[int], timeout_s: float | None = None) -> None:
    """Planned removal at an op boundary (like recover_ranks); removed ranks then get
    RankRemovedError from their next op at/after the boundary.

    Raises:
        TimeoutError: not committed within timeout_s.
    """
    gs = _gs(group)
    removing = gs.ctl.request(Deactivate(gs.name, list(ranks)))["removing"]
    gs.wait_until(lambda: all(r not in gs.active for r in removing), timeout_s or _timeout_s,
                  f"removal of {removing}")
