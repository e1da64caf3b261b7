"""The inner groups of one epoch of an elastic group: its ProcessGroupGloo and, for CUDA
tensors, its NCCL communicator (`nccl_inner.NcclComm`).

Both are built on background threads as soon as the epoch commits (the NCCL one once
the group has seen a CUDA op), so that the first op of a new epoch rarely waits. The
owner (`state.GroupState`) is passed in, not imported at run time: this module sits
below it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .gloo_device import new_gloo_group
from .nccl_inner import NcclComm

if TYPE_CHECKING:  # the owner, for type hints only (it imports this module)
    from .state import GroupState


class Superseded(Exception):
    """A newer failure decision arrived while waiting; the op must be re-evaluated."""


class EpochGroups:
    """The inner groups of one epoch: a ProcessGroupGloo, built on a background thread,
    and (for CUDA tensors) an `NcclComm`, built on first use or, once the group has
    seen a CUDA op, as soon as the epoch commits."""

    def __init__(self, gs: GroupState, epoch: int, active: tuple[int, ...]) -> None:
        self.epoch, self.pg, self.error = epoch, None, None
        self.active = active
        self.last_work = None
        self.nccl: NcclComm | None = None
        self.ready = threading.Event()
        prefix = f"elastic/{gs.name}/e{epoch}/"
        self._prefix = prefix
        rank, size = active.index(gs.slot), len(active)
        timeout = timedelta(seconds=gs.timeout_s)
        if gs.cuda_device is not None:
            self._start_nccl(gs, gs.cuda_device)

        def build() -> None:
            try:
                # A store client of its own: TCPStore clients serialise requests, and a
                # rendezvous blocked on a dead member must not stall the next epoch's.
                store = gs.new_store()
                self.pg = new_gloo_group(dist.PrefixStore(prefix, store), rank, size,
                                         timeout, gs.ctl.local_addr)
            except Exception as e:  # a member died during rendezvous; a new epoch follows
                self.error = e
            self.ready.set()

        threading.Thread(target=build, daemon=True, name=f"elastic-inner-{gs.name}-e{epoch}"
                         ).start()

    def get(self, gs: GroupState, gen: int, deadline: float):
        while not self.ready.wait(0.05):
            gs._check_gen(gen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"inner group of epoch {self.epoch} not built in time")
        if self.pg is None:
            self._await_next_failure(gs, gen, deadline, f"inner group failed: {self.error}")
        return self

    def _await_next_failure(self, gs: GroupState, gen: int, deadline: float, why: str) -> None:
        """A member died during rendezvous: block until the failure decision that replaces
        this epoch arrives, then raise Superseded (TimeoutError past ``deadline``)."""
        with gs.cond:
            while gs.failure_gen == gen:
                gs._check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"epoch {self.epoch}: {why}")
                gs.cond.wait(0.05)
        raise Superseded

    def _start_nccl(self, gs: GroupState, device: torch.device) -> NcclComm:
        parent, excluded = gs._shrink_from.pop(self.epoch, (None, None))
        self.nccl = NcclComm(gs.new_store, self._prefix + "nccl/", self.active.index(gs.slot),
                             len(self.active), device, gs.timeout_s, parent, excluded)
        gs.nccl_comms[self.epoch] = self.nccl
        return self.nccl

    def cuda(self, gs: GroupState, device: torch.device, gen: int, deadline: float) -> NcclComm:
        """This epoch's NCCL communicator, ready (built on first use).

        Raises:
            Superseded: a newer failure decision arrived while waiting.
            ValueError: the group's CUDA ops moved to another device.
            TimeoutError: not built by `deadline`.
        """
        comm = self.nccl
        if comm is not None and comm.ready.is_set() and comm.pg is not None:
            if comm.device != device:
                raise ValueError(f"group {gs.name!r}: CUDA ops on {device}, communicator on "
                                 f"{comm.device}")
            return comm
        with gs.cond:
            if gs.cuda_device is None:
                gs.cuda_device = device
            comm = self.nccl or self._start_nccl(gs, device)
        while not comm.ready.wait(0.002):
            gs._check_gen(gen)
            if time.monotonic() > deadline:
                raise TimeoutError(f"nccl communicator of epoch {self.epoch} not built in time")
        if comm.pg is None or comm.error is not None:
            self._await_next_failure(gs, gen, deadline,
                                     f"nccl communicator failed: {comm.error}")
        return comm

    def reapable(self) -> bool:
        """True once no op of this epoch can still be running (or its comm is aborted)."""
        w = self.last_work
        return (w is None or w.is_completed()) and (self.nccl is None or self.nccl.idle())

    def close(self) -> None:
        """Release both inner groups and the last work (reaper thread only: may block)."""
        if self.nccl is not None:
            self.nccl.close()
        self.pg = self.last_work = None
