"""Fault-tolerant elastic process groups (the "elastic" torch.distributed backend).

Importing this package registers the backend "elastic". Membership lives in a
coordinator process (`elasticep.membership.start_coordinator`); each group runs its ops
on a real inner ProcessGroupGloo per epoch, and CUDA tensors on an inner ProcessGroupNCCL of the same
epoch (`nccl_inner`: polled waits, abort on a failure commit, the previous
communicator shrunk or a fresh one per epoch). `all_to_all_single` is the data path's
entry that skips torch.distributed's dispatch in steady state. Of elasticep it imports
only `elasticep.membership` (the messages, the slot states, the errors).

Engine-facing semantics (WORLD created with on_failure="raise")
----------------------------------------------------------------
* Every collective on a group takes a sequence number; all members issue the same ops
  in the same order, so seq k is "the same op" everywhere. send/recv take none.
* When members die the coordinator commits a failure decision from the survivors'
  reports: r = lowest op some survivor has not completed, M = highest op some survivor
  completed (normally M <= r). For each survivor, at its current op (or at its next op
  call if it is idle):
    - seq <= M and every op r..M is fetchable (all_reduce, broadcast, all_gather,
      all_gather_into_tensor, reduce_scatter_tensor, barrier): the op returns the result
      a survivor kept (the full, pre-failure result). So a step's final "commit"
      all_reduce that some survivor already returned is returned on all survivors.
    - seq == M + 1 (completed by nobody): on_failure="complete" re-runs it over the
      survivors (broadcast only if its root survived); on_failure="raise", or an op
      that cannot be redone (all_to_all_single, and broadcast from a dead root), raises
      `RankFailureError(dead_ranks, epoch)`.
    - if some op in r..M is not fetchable (e.g. an all_to_all_single another survivor
      finished), every survivor raises at its current op.
  A survivor raises at most once per failure decision. After raising, every survivor's
  next op has seq M + 2, i.e. sequence numbers are aligned and that op runs on the new
  epoch's inner group. No survivor ever returns a result another survivor raised at,
  except the non-fetchable case above, where every survivor raises within the step.
* `get_current_epoch(group)` / `get_active_ranks(group)` / `has_pending_change(group)`
  read local state (no collective, no I/O); `add_change_listener(group, fn)` calls `fn`
  when the last may have turned true (so a watcher need not poll it).
* Admission: survivors call `recover_ranks(group, ranks)` (the first call triggers it,
  later calls are no-ops); ops in flight finish in the old epoch and ops from the
  boundary `max(started) + 1` run in the new one, where the joiner's `join_group`
  starts. If all survivors call it at the same step boundary, the next op is the first
  op of the joiner. `deactivate_ranks` works the same way; the removed rank's next op
  raises `RankRemovedError`.
* A rank declared failed while alive (frozen past the heartbeat timeout) raises
  `RankEvictedError` from its next call and never returns a result after resuming
  (its lease is re-confirmed with the coordinator before completing an op).
* Other outcomes: `TimeoutError` when an op makes no progress for `timeout_s` (the
  group is then unusable); `CoordinatorLostError` when the coordinator is gone.
  Collectives run synchronously; with async_op=True the returned Work is already
  complete. Exception: a CUDA all_to_all_single in an on_failure="raise" group is
  stream-ordered (the host returns once it is enqueued; the caller's stream waits for
  it), see `nccl_inner`. gather/scatter/reduce are an all_gather/broadcast/all_reduce
  whose result only the root (scatter: each rank's own part) keeps.
* send/recv (isend/irecv, batch_isend_irecv in any order) carry no sequence number and
  are asynchronous: they run on a channel per peer pair that no epoch change touches
  (`p2p`), and `wait()` raises `RankFailureError([peer])` once the peer's slot failed,
  was removed or was replaced. CUDA tensors are refused (ValueError).
* A collective or send/recv on a group this rank has not joined yet (an extension
  rank before admission) or has destroyed raises ValueError. WORLD may be destroyed
  and initialised again in one process: the control connection is kept, and a group
  created again under a name this process shut down is registered as a new group.
* Supervisor side (launcher / front-end): `elasticep.membership.CoordinatorClient(address)`
  with `status()` (epoch, per-slot states, pids), `report_death(rank, pid)` (waitpid), and
  `request_admission` / `request_deactivation`, which ranks read with
  `get_pending_requests(group)` and apply at an agreed step boundary.
* Performance: ranks sharing cores should `torch.set_num_threads(cores // ranks)`;
  each op copies its input once and its result back once (abandoned inner ops may
  still write their buffers, so user tensors are never handed to Gloo).
* Layout: `size()` == max group size; inactive slots get zero splits in
  all_to_all_single (their data is skipped, their output rows are zero) and zero-filled
  entries in all_gather.
"""

import torch.distributed as _dist

from elasticep.membership.errors import (
    CoordinatorLostError,
    ElasticError,
    EpochChangedError,
    RankEvictedError,
    RankFailureError,
    RankRemovedError,
)

from .api import (
    BackendOptions,
    _create_backend,
    add_change_listener,
    add_leader_listener,
    all_to_all_single,
    deactivate_ranks,
    get_active_ranks,
    get_current_epoch,
    get_peer_state,
    get_pending_requests,
    get_slot_states,
    group_diagnostics,
    has_pending_change,
    init_process_group,
    join_group,
    recover_ranks,
    store_client,
    wait_removal_known,
)
from .leader_store import LeaderStore
from .process_group import ElasticProcessGroup

if "elastic" not in _dist.Backend.backend_list:
    _dist.Backend.register_backend("elastic", _create_backend, extended_api=True,
                                   devices=["cpu"])

__all__ = [
    "BackendOptions", "add_change_listener", "add_leader_listener", "all_to_all_single", "CoordinatorLostError",
    "ElasticError", "ElasticProcessGroup", "EpochChangedError", "RankEvictedError",
    "RankFailureError", "RankRemovedError", "deactivate_ranks", "get_active_ranks",
    "get_current_epoch", "get_peer_state", "get_pending_requests", "get_slot_states",
    "group_diagnostics", "LeaderStore", "store_client",
    "has_pending_change", "init_process_group", "join_group", "recover_ranks",
    "wait_removal_known",
]
