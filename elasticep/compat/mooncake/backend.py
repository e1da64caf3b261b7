"""`MooncakeProcessGroup`: an elastic group that keeps Mooncake PG's contract.

Where the two contracts differ (our own is in `elasticep.distributed`'s docstring):

* Sizes: `size()` is the number of ranks in the group's view (a joiner not admitted
  yet reports the size it declared), and all_gather / reduce_scatter / gather /
  scatter buffers hold one chunk per rank of the view, in slot order. Natively the
  group has `max_group_size` slots with holes.
* The view: with ``auto_deactivate_on_failure`` (the default) it is the committed
  active set. Without it (manual membership) a dead rank stays in the view until
  `deactivate_ranks`; every op until then reports failure, and its result is the one
  the survivors computed together, never a sum with a dead rank's stale buffer.
* Per-op results: a Work carries `local_success` and `failed_ranks_hint` (int32
  [max_group_size], 1 for a rank the op lost) instead of raising.
* A joiner before `join_group` runs all_reduce, broadcast (from itself) and barrier
  on its own, as a group of one.
* Subgroup capacity past the given ranks is reserved for whichever global ranks join
  it (natively: the ranks after max(ranks)).
"""

from __future__ import annotations

import os

import torch

from elasticep.distributed import api
from elasticep.distributed.process_group import ElasticProcessGroup
from elasticep.distributed.solo import DoneWork
from elasticep.membership.errors import RankFailureError

from . import launch

VIEW_WAIT_S = 5.0  # see MooncakeProcessGroup._await_view
# process-wide settings of the `pg.set_*` calls (seconds and strings)
SETTINGS: dict = {"timeout_s": api.DEFAULT_TIMEOUT_S, "host": None}
# WORLD's rendezvous store, held past destroy_process_group (see create_backend)
_world_store: list = [None]


class MooncakeBackendOptions:
    """``pg_options`` of a Mooncake group; every constructor form of Mooncake PG:

    ``(max_group_size)``, ``(max_group_size, is_extension)``,
    ``(max_group_size, is_extension, auto_deactivate_on_failure, auto_sync_on_failure)``,
    ``(active_ranks)``, ``(active_ranks, is_extension)``,
    ``(active_ranks, is_extension, max_group_size)``; active_ranks is an int tensor
    [max_group_size] whose nonzero entries are the initially active slots.

    Raises:
        TypeError: another argument form.
    """

    def __init__(self, *args, **kwargs) -> None:
        names = (("active_ranks", "is_extension", "max_group_size")
                 if args and isinstance(args[0], torch.Tensor) or "active_ranks" in kwargs
                 else ("max_group_size", "is_extension", "auto_deactivate_on_failure",
                       "auto_sync_on_failure"))
        if len(args) > len(names) or set(kwargs) - set(names):
            raise TypeError(f"MooncakeBackendOptions takes {names}, got {len(args)} "
                            f"positional and {sorted(kwargs)}")
        given = dict(zip(names, args, strict=False)) | kwargs
        mask = given.get("active_ranks")
        self.active_ranks = None if mask is None else mask.to(torch.int32).flatten().clone()
        self.max_group_size = given.get("max_group_size") or (
            None if mask is None else mask.numel())
        self.is_extension = bool(given.get("is_extension", False))
        self.auto_deactivate_on_failure = bool(given.get("auto_deactivate_on_failure", True))
        self.auto_sync_on_failure = bool(given.get("auto_sync_on_failure", True))


class _ResultWork(DoneWork):
    """A complete Work with Mooncake's per-op result (`local_success`,
    `failed_ranks_hint`)."""

    def __init__(self, capacity: int, failed: list[int] = (), result=None) -> None:
        super().__init__(result)
        self.capacity, self.failed = capacity, list(failed)

    @property
    def local_success(self) -> bool:
        return not self.failed

    def failed_ranks_hint(self) -> torch.Tensor:
        hint = torch.zeros(self.capacity, dtype=torch.int32)
        hint[self.failed] = 1
        return hint


class _P2PResultWork(_ResultWork):
    """A send/recv: completes in `wait`; a lost peer makes it fail instead of raising."""

    def __init__(self, group: MooncakeProcessGroup, inner) -> None:
        super().__init__(len(group.gs.ranks))
        self.group, self.inner, self._waited = group, inner, False

    def wait(self, timeout=None) -> bool:
        if not self._waited:
            self._waited = True
            try:
                self.inner.wait(timeout)
            except RankFailureError as e:
                self.failed = e.dead_ranks
                self.group.settle(e.dead_ranks)
        return True

    def is_completed(self) -> bool:
        return self._waited

    @property
    def local_success(self) -> bool:
        self.wait()
        return not self.failed


class MooncakeProcessGroup(ElasticProcessGroup):
    """An elastic group with Mooncake PG's contract (see the module docstring).

    Args:
        gs: the native group state (`api.register_group`).
        declared_size: the group size torch was given (what a joiner reports).
        options: the group's MooncakeBackendOptions.
        backend_name: "mooncake" or "mooncake-cpu".
    """

    def __init__(self, gs, declared_size: int, options: MooncakeBackendOptions,
                 backend_name: str) -> None:
        super().__init__(gs, gs.slot, len(gs.ranks))
        self.declared_size, self.backend_name = declared_size, backend_name
        self.auto_deactivate = options.auto_deactivate_on_failure
        self.auto_sync = options.auto_sync_on_failure and self.auto_deactivate
        self._manual_view: set[int] | None = None if self.auto_deactivate else set(gs.active)

    # membership view ----------------------------------------------------------
    def view(self) -> list[int]:
        """Slots of the group's view, sorted (see the module docstring)."""
        if self._manual_view is None or not self.gs.joined:
            return sorted(self.gs.active)
        return sorted(self._manual_view)

    def view_add(self, slots) -> None:
        if self._manual_view is not None:
            self._manual_view |= set(slots)

    def view_remove(self, slots) -> None:
        if self._manual_view is not None:
            self._manual_view -= set(slots)

    def settle(self, dead: list[int]) -> None:
        """After an op lost `dead`: with auto sync, return only once the committed view
        no longer holds them (Mooncake applies the new view before completing the op)."""
        if self.auto_sync:
            self.gs.wait_until(lambda: not set(dead) & set(self.gs.active), self.gs.timeout_s,
                               f"the view without {dead}")

    def size(self) -> int:
        return len(self.view()) if self.gs.joined else self.declared_size

    def getBackendName(self) -> str:
        return self.backend_name

    def name(self) -> str:
        return self.backend_name

    # collectives ----------------------------------------------------------------
    def _collective(self, run, result=None) -> _ResultWork:
        """Run a native collective; report the view's ranks it lost."""
        before = set(self.view())
        try:
            run()
            failed = sorted(before - set(self.gs.active))
        except RankFailureError as e:
            failed = e.dead_ranks
        if failed:
            self.settle(failed)
        return _ResultWork(len(self.gs.ranks), failed, result)

    def _solo(self) -> bool:
        """A joiner before admission runs the group-of-one ops by itself."""
        return not self.gs.joined

    def allreduce(self, tensors, opts=None):
        if self._solo():
            return _ResultWork(len(self.gs.ranks), result=tensors)
        return self._collective(lambda: ElasticProcessGroup.allreduce(self, tensors, opts),
                                tensors)

    def broadcast(self, tensors, opts=None):
        if self._solo() and getattr(opts, "rootRank", 0) == self.gs.slot:
            return _ResultWork(len(self.gs.ranks), result=tensors)
        return self._collective(lambda: ElasticProcessGroup.broadcast(self, tensors, opts),
                                tensors)

    def barrier(self, opts=None):
        if self._solo():
            return _ResultWork(len(self.gs.ranks))
        return self._collective(lambda: ElasticProcessGroup.barrier(self, opts))

    def reduce(self, tensors, opts=None):
        return self._collective(lambda: ElasticProcessGroup.reduce(self, tensors, opts),
                                tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        def run():
            for outs, inp in zip(output_tensors, input_tensors, strict=True):
                full = self._slot_list(outs, inp, "all_gather")
                ElasticProcessGroup.allgather(self, [full], [inp], opts)
                self._compact(full, outs)
        return self._collective(run, output_tensors)

    def all_gather_single(self, output, input, opts=None):
        def run():
            chunks = self._chunks(output, input.shape[0], "all_gather_into_tensor")
            full = [torch.empty_like(input) for _ in self.gs.ranks]
            ElasticProcessGroup.allgather(self, [full], [input], opts)
            self._compact(full, chunks)
        return self._collective(run, output)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        def run():
            chunks = self._chunks(input, output.shape[0], "reduce_scatter")
            full = torch.zeros((len(self.gs.ranks) * output.shape[0], *output.shape[1:]),
                               dtype=input.dtype)
            n = output.shape[0]
            for s, c in zip(self.view(), chunks, strict=True):
                full[s * n:(s + 1) * n] = c
            ElasticProcessGroup.reduce_scatter_single(self, output, full, opts)
        return self._collective(run, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            work = self.reduce_scatter_single(out, torch.cat(ins), opts)
        return work

    def gather(self, output_tensors, input_tensors, opts=None):
        root = getattr(opts, "rootRank", 0)

        def run():
            outputs = output_tensors or [[] for _ in input_tensors]  # none on non-roots
            for outs, inp in zip(outputs, input_tensors, strict=True):
                full = self._slot_list(outs, inp, "gather") if self.gs.slot == root else []
                ElasticProcessGroup.gather(self, [full], [inp], opts)
                if full:
                    self._compact(full, outs)
        return self._collective(run, output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = getattr(opts, "rootRank", 0)

        def run():
            for i, out in enumerate(output_tensors):
                full = []
                if self.gs.slot == root:
                    full = self._slot_list(input_tensors[i], out, "scatter")
                    for s, t in zip(self.view(), input_tensors[i], strict=True):
                        full[s] = t
                ElasticProcessGroup.scatter(self, [out], [full], opts)
        return self._collective(run, output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        raise NotImplementedError("all_to_all_single is not part of Mooncake PG's contract; "
                                  "use an elastic group (elasticep.distributed)")

    alltoall_base = all_to_all_single

    # point to point ---------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return _P2PResultWork(self, ElasticProcessGroup.send(self, tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return _P2PResultWork(self, ElasticProcessGroup.recv(self, tensors, src, tag))

    # layout helpers -----------------------------------------------------------------
    def _slot_list(self, outs: list, like: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Per-slot tensors for a native op whose caller gave one per rank of the view."""
        self._await_view(len(outs), what)
        return [torch.zeros_like(like) for _ in self.gs.ranks]

    def _chunks(self, t: torch.Tensor, unit: int, what: str) -> list[torch.Tensor]:
        """`t` split into one chunk of `unit` rows per rank of the view."""
        if unit <= 0 or t.shape[0] % unit:
            raise ValueError(f"{what}: dim0 {t.shape[0]} is not a multiple of {unit}")
        self._await_view(t.shape[0] // unit, what)
        return list(t.chunk(t.shape[0] // unit))

    def _await_view(self, n: int, what: str) -> None:
        """A buffer sized for `n` ranks while the view has another size: a rank died (or
        was admitted) and the change is not applied here yet; wait a little for it.

        Raises:
            ValueError: the view did not reach `n` ranks within VIEW_WAIT_S.
        """
        if len(self.view()) == n:
            return
        try:
            self.gs.wait_until(lambda: len(self.view()) == n, VIEW_WAIT_S, "")
        except TimeoutError:
            raise ValueError(f"{what}: buffers for {n} ranks, the group has "
                             f"{len(self.view())} (view {self.view()})") from None

    def _compact(self, full: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for o, s in zip(outs, self.view(), strict=True):
            o.copy_(full[s].reshape(o.shape))


def create_backend(dopts, options: MooncakeBackendOptions | None,
                   backend_name: str) -> MooncakeProcessGroup:
    """torch.distributed backend creator (extended API) of "mooncake" / "mooncake-cpu".

    WORLD (first group of a process) connects to the coordinator, found through torch's
    rendezvous store or started detached (`launch`).

    Raises:
        ValueError: options inconsistent with the group, or refused by the coordinator.
    """
    opts = options if options is not None else MooncakeBackendOptions(dopts.group_size)
    given = list(dopts.global_ranks_in_group)
    capacity = opts.max_group_size or len(given) or dopts.group_size
    timeout_s = min(SETTINGS["timeout_s"], dopts.timeout.total_seconds())
    if not given:  # WORLD: the group rank is the global rank
        # Rank 0 hosts the env:// store's server, and torch's env:// stores are
        # multi-tenant: a new one on the same port reuses this process's live server.
        # Held here, the server outlives WORLD, so ranks that re-create WORLD before
        # rank 0 has destroyed it check in where rank 0's next store looks. Unheld, it
        # died with WORLD, and rank 0's new server waited for those check-ins until its
        # timeout. Joiners also keep finding the coordinator's address in it.
        _world_store[0] = dopts.store
        host = SETTINGS["host"] or os.environ.get("MASTER_ADDR", "127.0.0.1")
        # WORLD created again (destroyed first) keeps the process's coordinator
        address = api.control_address() or launch.coordinator_address(dopts.store, host,
                                                                       timeout_s)
        api.connect(address, dopts.group_rank, capacity, world_size=dopts.group_size,
                    is_extension=opts.is_extension, timeout_s=timeout_s)
        ranks = list(range(capacity))
    else:
        ranks = given + [-1] * (capacity - len(given))  # reserved: bound when joined
    if len(ranks) != capacity:
        raise ValueError(f"max_group_size {capacity} is smaller than the group's "
                         f"{len(ranks)} ranks")
    mask = opts.active_ranks
    if mask is None:
        mask = torch.zeros(capacity, dtype=torch.int32)
        mask[:dopts.group_size] = 1
    native = api.BackendOptions(mask, opts.is_extension, capacity, global_ranks=ranks)
    gs = api.register_group(dopts, native)
    return MooncakeProcessGroup(gs, dopts.group_size, opts, backend_name)
