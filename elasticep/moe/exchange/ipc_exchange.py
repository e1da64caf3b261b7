"""The same-host expert exchange: peers write into each other's mapped buffers, inside a
CUDA graph (``--moe-a2a-backend cuda_ipc``).

The padded all_to_all (:mod:`elasticep.moe.exchange.padded_exchange`) is an eager collective
between graph pieces: a decode step of a 48-layer model is 97 pieces around 96 NCCL
calls. Here, ranks of one host map each other's receive buffers with CUDA IPC, and one
exchange is:

1. a send kernel (:mod:`elasticep.moe.exchange.ipc_kernels`) that writes this rank's rows into
   every active destination's buffer at this rank's row block, then sets a flag there;
2. per peer ``q``, a stream wait until ``flags_me[q, slot] == 1``
   (:mod:`elasticep.moe.exchange.stream_memops`; the stream waits without holding an SM, which
   is what ranks sharing one GPU need: spinning kernels of two processes take turns in
   time slices). The next exchange's send kernel sets the flag back to 0
   (``ELASTICEP_IPC_FLAG_RESET=kernel``, the default). ``=memop`` resets it with a
   stream write right after the wait instead: one more graph node per exchange, and
   every node of a one-token decode graph costs its launch, where the kernel's reset
   is a store the send kernel makes anyway.

While no peer is active (``--ep-size 1`` with room to grow), every wait is for a peer
whose flag the send kernel sets itself. The decode graphs then replay a variant captured
without the waits (:data:`SOLO`; the executor's ``graph_variant``); the host picks it
from the membership that :meth:`reset` loads, at a boundary every rank agreed on, so no
peer sends to a rank that runs it.

Nothing in it is a collective call, so the decode forward is one graph. The graph reads
the pointer table and the ``active`` mask from device memory; the layout of the rows is
:func:`~elasticep.moe.exchange.padded_exchange.plan_padded`'s, so the grouped GEMM and the combine
are the padded path's.

Memory (:mod:`elasticep.moe.exchange.ipc_buffers`), per rank (``G = max_ep_size``,
``C_max`` rows per source block for the largest step, ``W`` =
:func:`~elasticep.moe.exchange.padded_exchange.row_width`): a dispatch buffer
``[G*C_max, W]`` and a combine buffer ``[G*C_max, H]`` in the model dtype (two, because a
peer one phase ahead already writes its combine rows while this rank reads dispatch
rows), flags ``[G, 2*moe_layers]`` int32 (one column per exchange of a step: a column is
reused only one step later, after an exchange of every rank in between) and a counter
``[G]``. They are one allocation, exported as one IPC handle through the rendezvous
store.

Faults. A peer that dies or stops never signals; a host watchdog (:meth:`abort`, called
from a thread while a step runs: on a membership change announced by the coordinator,
or at a deadline) writes 0 to every peer's ``active`` word and 1 to every flag of this
rank, from a side stream, so the blocked stream runs on and the step's remaining
exchanges are local. The step's results are then wrong, and the step loop's commit
agreement redoes it. :meth:`reset` (every rank, at the agreed boundary after the redo
decision, when every send of the abandoned step has completed) clears the flags and
counters and reloads ``active`` from the membership. A late write of a stopped peer lands
only in its own row block, which nobody reads once it is inactive: the tags of inactive
sources read as 0 and every tag is clamped to the slot range (by one elementwise min in
:meth:`recv_dispatch`, or, at decode sizes, by the expert kernels as they read them).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticep.moe.exchange import ipc_kernels as kernels
from elasticep.moe.exchange import stream_memops
from elasticep.moe.exchange.ipc_buffers import IpcBuffers
from elasticep.moe.exchange.padded_exchange import (
    PaddedHandle,
    PaddedPlan,
    plan_padded,
    split_rows,
)
from elasticep.moe.exchange.pair_combine import combine_pairs
from elasticep.utils import graph_boundary

logger = logging.getLogger(__name__)

# The graph variant of a decode step in which no peer is active: it holds no wait. A
# wait for an inactive peer passes at once (the send kernel sets that flag itself), but
# each stream wait node is still a node the graph stops at, two per MoE layer, which
# at one token is a share of the step worth a second capture.
SOLO = "solo"
RESET_ENV = "ELASTICEP_IPC_FLAG_RESET"


@dataclass(frozen=True)
class IpcHandle(PaddedHandle):
    """The layout of one same-host dispatch (the padded one's), and which exchange of
    the step it was: what its receive, its combine and the fused sends take.

    Attributes:
        layer: the decoder layer (a MoE one), which names the step's flag columns.
        slots_per_rank: S, the bound of the received tags.
    """

    layer: int
    slots_per_rank: int


class IpcExchange(IpcBuffers):
    """One rank's side of the same-host exchange: the exchange calls, the flags' waits and
    the fault release, over its buffers and the peers' mapped ones (:class:`IpcBuffers`).

    Args:
        rank: this rank (its row block in every peer's buffers).
        max_ep_size: G, slots of the deployment.
        cap_rows: ``C_max`` (:func:`capacity_rows`).
        hidden_size: H.
        dtype: model dtype of the rows.
        num_layers: decoder layers.
        device: this rank's device. ``"cpu"`` runs the torch reference of every kernel and
            checks each wait instead of blocking (a one-process simulation for tests:
            the peers are other :class:`IpcExchange` objects given to :meth:`map_local`).
        moe_layers: the decoder layers that exchange, in forward order (None: all
            ``num_layers``). Each gets two flag columns, numbered in this order, so the
            exchanges of a step use consecutive columns (dense layers, e.g. DeepSeek's
            ``first_k_dense_replace``, leave no gap that a send's ``reset_prev`` would
            clear instead of the column before it).

    Raises:
        ImportError: on CUDA without the ``cuda-bindings`` package.
        ValueError: ``moe_layers`` is empty, out of range or not increasing.
    """

    def __init__(self, rank: int, max_ep_size: int, cap_rows: int, hidden_size: int,
                 dtype: torch.dtype, num_layers: int, device: torch.device | str,
                 moe_layers: Sequence[int] | None = None) -> None:
        self.num_layers = num_layers
        layers = list(range(num_layers)) if moe_layers is None else [int(x) for x in moe_layers]
        if not layers or layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] \
                < num_layers:
            raise ValueError(f"moe_layers {layers}: want increasing decoder layers in "
                             f"[0, {num_layers})")
        # decoder layer -> its dispatch flag column (the combine's is the next one)
        self._column = {layer: 2 * i for i, layer in enumerate(layers)}
        if torch.device(device).type == "cuda":
            stream_memops.driver()  # fail now, naming the package, not inside a capture
        super().__init__(rank, max_ep_size, cap_rows, hidden_size, dtype, 2 * len(layers),
                         device)
        if self.cuda:
            index = (self.device.index if self.device.index is not None
                     else torch.cuda.current_device())
            self.batched_waits = stream_memops.batch_works(index)
        self.solo = True  # the host's view of ``active``: no peer in it (see SOLO)
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._aborted = False
        self._lock = threading.Lock()
        # per slot count S: [G, 1] int32, S for active sources and 0 for the rest (one
        # elementwise min masks and clamps the received tags; refreshed by reset)
        self._tag_caps: dict[int, torch.Tensor] = {}
        # who clears a waited flag: "kernel", the next exchange's send kernel
        # (reset_prev; the wait node only waits), or "memop", a stream write right
        # after the wait (one more graph node per exchange)
        mode = os.environ.get(RESET_ENV, "kernel")
        if mode not in ("memop", "kernel"):
            raise ValueError(f"{RESET_ENV}={mode!r}: expected 'memop' or 'kernel'")
        self.reset_in_kernel = mode == "kernel"
        self.aborts = 0

    def warm_kernels(self) -> None:
        """Compile the send kernels now, not inside the first graph capture, with a
        private self-only table, mask and flags, so nothing reaches a peer (for this
        reset mode; the fused forms warm their own kernels,
        :meth:`elasticep.moe.fused_exchange.FusedForms.warm`)."""
        if not self.cuda:
            return
        recv0, table, active, counter, flags, scratch = self.private_state()
        C = 8
        reset = self.reset_in_kernel
        hidden = torch.zeros(1, self.H, dtype=self.dtype, device=self.device)
        slots = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        position, tag, inv = kernels.fused_plan(slots, 1, self.G, C)
        plan = PaddedPlan(position, tag, self.G, C)
        kernels.dispatch_send(hidden, inv, plan.tag, 1, self.rank, C, self.W, table, active,
                              counter, flags, 0, reset)
        out = torch.zeros(self.G * C, self.H, dtype=self.dtype, device=self.device)
        kernels.combine_send(out, recv0, self.rank, C, table, active, counter, flags, 1,
                             reset)
        torch.cuda.synchronize(self.device)
        del scratch

    # ------------------------------------------------------------------ membership
    def reset(self, active: torch.Tensor) -> None:
        """Clear flags and counters and load ``active`` ([G] bool or int, the membership),
        then wait for the device: call at a boundary every rank agreed on, before any
        rank's next exchange (the step loop's redo and membership changes)."""
        mask = active.to(torch.int32).to(self.device)
        mask[self.rank] = 1
        with self._lock:
            self.flags.zero_()
            self.counter.zero_()
            self.active.copy_(mask)
            for S, cap in self._tag_caps.items():
                cap.copy_((mask * S).view(-1, 1))
            self.solo = int(mask.sum()) == 1
            self._aborted = False
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def abort(self) -> None:
        """Release every wait of the running step (host watchdog; any thread): every peer
        becomes inactive and every flag of this rank reads 1, written from a side stream
        with stream memory writes. Idempotent until :meth:`reset`."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            self.aborts += 1
            if not self.cuda:
                self.active.zero_()
                self.active[self.rank] = 1
                self.flags.fill_(1)
                return
            with torch.cuda.device(self.device):
                for q in range(self.G):
                    if q != self.rank:
                        stream_memops.write_value32(self.active[q].data_ptr(), 0, self._side)
                for q in range(self.G):
                    for s in range(self.n_slots):
                        stream_memops.write_value32(self.flags[q, s].data_ptr(), 1, self._side)
                self._side.synchronize()

    @property
    def aborted(self) -> bool:
        """True from :meth:`abort` until :meth:`reset`: this step's results are garbage."""
        return self._aborted

    # ------------------------------------------------------------------ one exchange
    def flag_column(self, layer: int) -> int:
        """The dispatch flag column of decoder ``layer`` (its combine's is one more)."""
        try:
            return self._column[layer]
        except KeyError:
            raise ValueError(f"layer {layer} does not exchange (its MoE layers: "
                             f"{sorted(self._column)})") from None

    def check_capacity(self, C: int) -> None:
        if C > self.cap_rows:
            raise ValueError(f"exchange of {C} rows per block > the {self.cap_rows} the "
                             "buffers hold (a step larger than the deployment's step bound)")

    def _wait(self, slot: int) -> None:
        if graph_boundary.capture_variant() == SOLO:  # recorded for steps with no peer
            return
        if not self.cuda:  # simulation: every peer has run its send already
            for q in range(self.G):
                if q != self.rank:
                    if int(self.flags[q, slot]) != 1:
                        raise RuntimeError(f"rank {self.rank}: no signal from {q} at slot {slot}")
                    if not self.reset_in_kernel:
                        self.flags[q, slot] = 0
            return
        addrs = [self.flags[q, slot].data_ptr() for q in range(self.G) if q != self.rank]
        stream_memops.wait_and_reset32(addrs, reset=not self.reset_in_kernel)

    def _signal_local(self, slot: int) -> None:
        """CPU simulation of the kernels' flags: clear the previous exchange's flags
        (``reset_prev``), signal active peers, release the rest. A signal that finds its
        flag still set is a lost reset (on the GPU, a wait that would pass early)."""
        for q in range(self.G):
            if q == self.rank:
                continue
            if self.reset_in_kernel:
                self.flags[q, (slot - 1) % self.n_slots] = 0
            if int(self.active[q]):
                peer_flags = self._peer_views[q][2]
                if self.reset_in_kernel and not self._aborted and int(
                        peer_flags[self.rank, slot]) != 0:
                    raise RuntimeError(f"rank {self.rank}: flag {slot} of rank {q} still set "
                                       "from an earlier exchange (a lost reset)")
                peer_flags[self.rank, slot] = 1
            else:
                self.flags[q, slot] = 1

    def dispatch(self, hidden: torch.Tensor, slots: torch.Tensor, slots_per_rank: int,
                 C: int, layer: int, clamp: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, IpcHandle]:
        """Send this rank's pairs of ``layer`` and wait for every peer's
        (:meth:`send_dispatch`, then :meth:`recv_dispatch`).

        The membership is not an argument (Mooncake EP's ``active_ranks``): it is the
        ``active`` mask in device memory, which :meth:`reset` loads at agreed boundaries
        and :meth:`abort` clears from another thread while a step runs.

        Returns:
            ``rows`` [G*C, H] (a strided view), ``tags`` [G*C] int32 and the handle for
            :meth:`combine`.
        """
        handle = self.send_dispatch(hidden, slots, slots_per_rank, C, layer)
        rows, tags = self.recv_dispatch(handle, clamp)
        return rows, tags, handle

    def combine(self, expert_out: torch.Tensor, handle: IpcHandle, weights: torch.Tensor
                ) -> torch.Tensor:
        """Return ``expert_out`` ([G*C, H], rows as received) to their sources, wait for
        this rank's own and sum each token's k of them (:meth:`send_combine`, then
        :meth:`finish_combine`)."""
        self.send_combine(expert_out, handle)
        return self.finish_combine(handle, weights)

    def send_dispatch(self, hidden: torch.Tensor, slots: torch.Tensor, slots_per_rank: int,
                      C: int, layer: int) -> IpcHandle:
        """Write this rank's pairs of ``layer`` to their destinations and signal them.

        Args:
            hidden: [T, H] model dtype; slots: [T, k] int64 physical slots;
            slots_per_rank: S; C: rows per source block (the step's capacity, the same
                on every rank); layer: decoder layer (a MoE one: its flag column is
                ``2 * its position among the MoE layers``).

        Returns:
            The handle of this exchange, for its receive and its combine.

        Raises:
            ValueError: ``C`` exceeds the buffers, or ``layer`` does not exchange.
        """
        self.check_capacity(C)
        column = self.flag_column(layer)
        if kernels.plan_ok(slots):
            position, tag, inv = kernels.fused_plan(slots, slots_per_rank, self.G, C)
            plan = PaddedPlan(position, tag, self.G, C)
        else:
            plan = plan_padded(slots, slots_per_rank, self.G, C)
            inv = kernels.inverse_positions(plan.position, self.G * C)
        if self.cuda:
            kernels.dispatch_send(hidden.contiguous(), inv, plan.tag, slots.shape[1], self.rank,
                                  C, self.W, self.table, self.active, self.counter,
                                  self.flags, column, self.reset_in_kernel)
        else:
            active = [bool(a) for a in self.active.tolist()]
            dests = [self._peer_views.get(q, (None,))[0] for q in range(self.G)]
            kernels.dispatch_send_reference(hidden, inv, plan.tag, slots.shape[1], self.rank,
                                            C, dests, active)
            self._signal_local(column)
        return IpcHandle(plan.position, C, hidden.dtype, layer, slots_per_rank)

    def recv_dispatch(self, handle: IpcHandle, clamp: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for every peer's dispatch rows of ``handle``'s exchange; returns ``rows``
        [G*C, H] (a strided view) and ``tags`` [G*C] int32, with inactive sources' tags
        zeroed and every tag clamped to ``[0, slots_per_rank]`` (a stopped peer's late
        write is never read as an index).

        ``clamp=False`` leaves the tags as received: the caller then owes the clamp, by
        passing ``(tag_cap(slots_per_rank), C)`` as the expert compute's ``tag_bound``
        (one kernel a layer less). The combine send still reads the raw tags, which is
        safe: it writes only to active sources, and within their own row block."""
        C = handle.capacity
        self._wait(self.flag_column(handle.layer))
        rows, tags = split_rows(self.recv0[:self.G * C], self.H)
        if clamp:
            cap = self.tag_cap(handle.slots_per_rank)
            # an inactive source's tags become 0 and no tag exceeds S (the kernels treat
            # a tag <= 0 as padding)
            torch.minimum(tags.view(self.G, C), cap, out=tags.view(self.G, C))
        return rows, tags
    def tag_cap(self, slots_per_rank: int) -> torch.Tensor:
        """The ``[G, 1]`` int32 bound of received tags for ``slots_per_rank`` (made on
        first use; the executor asks for it when a placement is set, outside any graph
        capture, so a capture reads a tensor that :meth:`reset` keeps current)."""
        cap = self._tag_caps.get(slots_per_rank)
        if cap is None:
            if self.cuda and torch.cuda.is_current_stream_capturing():
                # made inside a capture, it would hold garbage for every eager step
                raise RuntimeError(f"tag bound for {slots_per_rank} slots first asked for "
                                   "inside a graph capture: set the executor's transport "
                                   "(or call tag_cap) before capturing")
            cap = self._tag_caps[slots_per_rank] = (self.active * slots_per_rank).view(-1, 1)
        return cap

    def send_combine(self, expert_out: torch.Tensor, handle: IpcHandle) -> None:
        """Return ``expert_out`` ([G*C, H], rows as received) to their sources and signal."""
        C, column = handle.capacity, self.flag_column(handle.layer) + 1
        if self.cuda:
            kernels.combine_send(expert_out.contiguous(), self.recv0, self.rank, C, self.table,
                                 self.active, self.counter, self.flags, column,
                                 self.reset_in_kernel)
        else:
            active = [bool(a) for a in self.active.tolist()]
            dests = [self._peer_views[q][1] if q in self._peer_views else None
                     for q in range(self.G)]
            tags = split_rows(self.recv0[:self.G * C], self.H)[1]
            kernels.combine_send_reference(expert_out, tags, self.rank, C, dests, active)
            self._signal_local(column)

    def recv_combine(self, handle: IpcHandle) -> torch.Tensor:
        """Wait for every peer's combine rows of ``handle``'s exchange; returns [G*C, H]
        in the send layout (the output of flat pair ``i`` is row ``handle.position[i]``)."""
        self._wait(self.flag_column(handle.layer) + 1)
        return self.recv1[:self.G * handle.capacity]

    def finish_combine(self, handle: IpcHandle, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`recv_combine`, then each token's k outputs weighted by ``weights``
        ([T, k] float32) and summed in float32: [T, H] in ``handle.dtype``."""
        back = self.recv_combine(handle)
        return combine_pairs(back, weights, handle.dtype, rows=handle.position)
