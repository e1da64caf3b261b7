"""Asynchronous send/recv of an elastic group, over one two-rank Gloo group per peer pair.

Why not the epoch's inner group: send/recv carry no sequence number, so the two ends
of one transfer can be posted on either side of an epoch change and would then wait
on different groups forever. A pair channel belongs to no epoch. It is named after
both ends' process tokens (each rank publishes one in the store when it registers),
so a relaunched rank meets its peers on a fresh channel, and a survivor drops its
channel to a slot once that slot has been out of the group.

Posting never blocks: each channel has a thread that builds its Gloo group and posts
the transfers in the order they were issued (Gloo matches transfers of one peer and
tag in order). So isend/irecv, and batch_isend_irecv, work in any order, a ring of
sends first included. `P2PWork.wait` waits in short slices and fails as soon as the
peer's slot is failed or removed, or this rank lost its membership.

The channels see their group only through `PeerGroup`: a few fixed facts and three
questions to its membership, so nothing here depends on how `GroupState` keeps them.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticep.membership.errors import RankFailureError
from elasticep.membership.transitions import SlotState

from .epoch_log import EpochLog
from .gloo_device import new_gloo_group
from .ops import _bytes
from .reaper import join_at_exit

SLICE = timedelta(milliseconds=50)
_GONE = (SlotState.FAILED, SlotState.FREE)


@dataclass(frozen=True)
class PeerGroup:
    """What a group's peer channels know of the group; its owner (`GroupState`) builds
    one, and the channels reach nothing else of it.

    Args:
        name: the group's unique name; slot: this rank's slot; size: slots in the group.
        timeout_s: bound of every blocking wait (seconds).
        local_addr: the address a channel's Gloo pair binds (the control connection's).
        store: client of the coordinator's TCPStore (this rank's token is published on it);
        new_store: makes another client of it (one per channel's rendezvous).
        epochs: the group's committed epochs (read only here).
        check_member: raises ValueError if this rank cannot run the named op yet.
        check_alive: raises RankEvictedError / CoordinatorLostError once this rank lost
            its membership.
        slot_state: the coordinator's latest state of a slot.
    """

    name: str
    slot: int
    size: int
    timeout_s: float
    local_addr: str
    store: object
    new_store: Callable[[], object]
    epochs: EpochLog
    check_member: Callable[[str], None]
    check_alive: Callable[[], None]
    slot_state: Callable[[int], SlotState]


class P2PWork(dist.Work):
    """One posted send or recv. `wait` completes it (a recv then fills the caller's
    tensor); until then the caller's tensor is neither read again nor written.

    Raises (wait):
        RankFailureError: the peer's slot failed, was removed or was replaced.
        RankEvictedError / CoordinatorLostError: this rank lost its membership.
        TimeoutError: no completion within the group's timeout (seconds).
    """

    def __init__(self, channel: _Channel, kind: str, tensor: torch.Tensor, tag: int) -> None:
        super().__init__()
        self.channel, self.kind, self.tensor, self.tag = channel, kind, tensor, tag
        self.peer = channel.peer
        # private buffers: an abandoned transfer may still touch them after wait() gave up
        self.buf = (tensor.detach().clone(memory_format=torch.contiguous_format)
                    if kind == "send" else torch.empty(tensor.shape, dtype=tensor.dtype))
        self._finished = threading.Event()
        self._inner = None
        self._error: BaseException | None = None
        self._done = False

    def post(self, pg, peer_rank: int) -> bool:
        """Post on the channel's Gloo group (channel thread only); False if it failed."""
        try:
            post = pg.send if self.kind == "send" else pg.recv
            self._inner = post([_bytes(self.buf)], peer_rank, self.tag)
            return True
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self.fail(e)
            return False

    def complete(self) -> None:
        """Block until Gloo finishes the transfer (completion thread only). A waiter
        never waits on Gloo with a timeout itself: Gloo closes the pair when one expires."""
        try:
            self._inner.wait()
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        self._finished.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._finished.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        limit = timeout.total_seconds() if timeout else self.channel.group.timeout_s
        deadline = time.monotonic() + limit
        while not self._finished.wait(SLICE.total_seconds()):
            self._check_peer(deadline)
        while self._error is not None:  # the peer's end went away (its death shows soon)
            self._check_peer(deadline, f": {self._error}")
            time.sleep(SLICE.total_seconds())
        if self.kind == "recv":
            self.tensor.copy_(self.buf)
        self._done = True
        return True

    def _check_peer(self, deadline: float, why: str = "") -> None:
        g = self.channel.group
        g.check_alive()
        if g.slot_state(self.peer) in _GONE or self.channel.stale():
            raise RankFailureError([self.peer], g.epochs.current, g.name)
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {g.slot} group {g.name!r}: {self.kind} with slot "
                               f"{self.peer} did not complete in time{why}")

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self.tensor])
        return fut


class _Channel:
    """The pair (this slot, `peer`): its Gloo group, the thread that posts on it and the
    one that completes the posted transfers."""

    def __init__(self, owner: PeerChannels, peer: int) -> None:
        self.owner, self.group, self.peer = owner, owner.group, peer
        # the epoch log's position at creation: a later epoch without `peer` makes us stale
        self._since = self.group.epochs.mark()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()  # posted, in order
        name = f"{self.group.name}-{self.group.slot}-{peer}"
        self.threads = (
            threading.Thread(target=self._run, daemon=True, name=f"elastic-p2p-{name}"),
            threading.Thread(target=_complete_in_order, args=(self.done,), daemon=True,
                             name=f"elastic-p2p-done-{name}"))
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """End both threads once the transfers already posted are done."""
        self.queue.put(None)
        join_at_exit(self.threads)

    def stale(self) -> bool:
        """True once the peer's slot was out of the group in an epoch after creation."""
        return self.group.epochs.left_since(self.peer, self._since)

    def _run(self) -> None:
        g, me, peer = self.group, self.group.slot, self.peer
        pg, error = None, None
        try:
            store = g.new_store()
            key = self.owner.token_key(peer)
            store.wait([key], timedelta(seconds=g.timeout_s))
            tokens = {me: self.owner.token, peer: store.get(key).decode()}
            lo, hi = sorted((me, peer))
            prefix = f"elastic/{g.name}/p2p/{lo}-{hi}/{tokens[lo]}/{tokens[hi]}/"
            pg = new_gloo_group(dist.PrefixStore(prefix, store), int(me > peer), 2,
                                timedelta(seconds=g.timeout_s), g.local_addr)
        except Exception as e:  # noqa: BLE001 - the peer never came: its waiters decide
            error = e
        while True:
            work = self.queue.get()
            if work is None:
                self.done.put(None)
                return
            if pg is None:
                work.fail(error)
            elif work.post(pg, int(peer > me)):
                self.done.put(work)


def _complete_in_order(done: queue.SimpleQueue) -> None:
    """Finish a channel's posted transfers in posting order. Order does not delay any
    transfer: Gloo's transport moves every posted one whether or not it is waited on."""
    while (work := done.get()) is not None:
        work.complete()


class PeerChannels:
    """A group's send/recv side: publishes this rank's token, keeps one channel per peer."""

    def __init__(self, group: PeerGroup) -> None:
        self.group = group
        self.token = f"{os.getpid()}-{secrets.token_hex(4)}"
        group.store.set(self.token_key(group.slot), self.token)
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()

    def rebase(self, store: object) -> None:
        """Use ``store`` (a new leader's rendezvous store) from now on: this rank's
        token is published there again, for channels built after a leader change."""
        self.group = replace(self.group, store=store)
        store.set(self.token_key(self.group.slot), self.token)

    def token_key(self, slot: int) -> str:
        return f"elastic/{self.group.name}/p2p-token/{slot}"

    def post(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> P2PWork:
        """Start a send ("send") or recv ("recv") of `tensor` with group slot `peer`.

        Returns at once; the transfer completes in `P2PWork.wait`.
        Raises:
            ValueError: bad peer, a CUDA tensor, or this rank is not a member yet.
        """
        g = self.group
        g.check_member(kind)
        if not 0 <= peer < g.size or peer == g.slot:
            raise ValueError(f"{kind}: peer slot {peer} is not another slot of group "
                             f"{g.name!r} (size {g.size}, this rank is {g.slot})")
        if tensor.is_cuda:
            raise ValueError(f"{kind} of CUDA tensors is not supported by the elastic backend")
        with self._lock:
            ch = self._channels.get(peer)
            if ch is None or ch.stale():
                if ch is not None:
                    ch.stop()
                ch = self._channels[peer] = _Channel(self, peer)
        work = P2PWork(ch, kind, tensor, tag)
        ch.queue.put(work)
        return work

    def close(self) -> None:
        """Stop every channel's thread (after the transfers already posted)."""
        with self._lock:
            chans, self._channels = list(self._channels.values()), {}
        for ch in chans:
            ch.stop()
