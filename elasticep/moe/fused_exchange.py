"""The fused forms of the same-host exchange: sends that also route or compute.

The transport (:class:`~elasticep.moe.exchange.ipc_exchange.IpcExchange`) moves rows and
sees neither router logits nor expert weights. At decode sizes three of a layer's
launches fold into its sends, and this module owns them; it composes the transport's
buffers and flags, the routing rule's device function
(:func:`~elasticep.moe.softmax_topk.softmax_topk_row`) and the per-row expert device
functions (:mod:`elasticep.moe.experts.small_batch_experts`):

* :meth:`FusedForms.send_dispatch_static`: the gather of each pair's slot from the static
  dispatch map, the plan and the send, in one kernel;
* :meth:`FusedForms.send_dispatch_routed`: the same for a one-token step, with the
  softmax top-k routing in the kernel too (the router's own kernel is not launched);
* :meth:`FusedForms.send_combine_down`: the expert down projection written straight
  into the sources' combine buffers, where the combine send would copy it from.

Each writes the rows, tags and flags the transport's plain sends write, so the
transport's receives, :meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.abort` and
:meth:`~elasticep.moe.exchange.ipc_exchange.IpcExchange.reset` serve them unchanged.
Where a form does not apply (the CPU simulation, sizes past its bounds,
``ELASTICEP_FUSED_DISPATCH=0``), the plain path does the same work in more launches.
"""

from __future__ import annotations

import logging
import os

import torch

from elasticep.moe import fused_exchange_kernels as fused
from elasticep.moe.exchange import ipc_kernels as kernels
from elasticep.moe.exchange.ipc_exchange import IpcExchange, IpcHandle
from elasticep.moe.exchange.padded_exchange import split_rows
from elasticep.moe.experts.small_batch_experts import MAX_ROWS, gate_up_rows
from elasticep.moe.softmax_topk import SoftmaxTopk, softmax_topk_reference

logger = logging.getLogger(__name__)


class FusedForms:
    """The fused sends over one rank's same-host exchange.

    Args:
        exchange: the transport whose buffers, pointer table, ``active`` mask and flags
            the fused kernels write, as its plain send kernels do.

    Attributes:
        fused_dispatch: whether the dispatch forms may fold the gather and the plan
            (and, for one token, the routing) into the send (``ELASTICEP_FUSED_DISPATCH``,
            default on; ``0``: the plain path's three launches).
    """

    def __init__(self, exchange: IpcExchange) -> None:
        self.exchange = exchange
        self.fused_dispatch = os.environ.get("ELASTICEP_FUSED_DISPATCH", "1") != "0"
        self._warm_routes: set[tuple] = set()  # the routed send's compiled forms

    # ------------------------------------------------------------------ warm-up
    def warm(self, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> None:
        """Compile the fused kernels a served step launches now, not inside the first
        graph capture, on private self-only state (nothing reaches a peer): the static
        fused dispatch at each scan width the buffers can take and, given a layer's
        ``w13`` [S, 2I, H] and ``w2`` [S, H, I], the bounded gate/up and the fused
        down-and-send on all-padding rows. A failure of the expert kernels is logged;
        they then compile at first use."""
        ex = self.exchange
        if not ex.cuda:
            return
        _, table, active, counter, flags, scratch = ex.private_state()
        hidden = torch.zeros(1, ex.H, dtype=ex.dtype, device=ex.device)
        slots = torch.zeros(1, 1, dtype=torch.int64, device=ex.device)
        l2p = torch.zeros(1, dtype=torch.int64, device=ex.device)
        # one step per scan width the buffers can take (n pairs select the width n
        # fits), one token a pair, all to slot 0 of this rank
        for n in sorted({min(w, ex.cap_rows, kernels.PLAN_MAX_PAIRS)
                         for w in fused.SCAN_BLOCKS}):
            fused.fused_dispatch(hidden.expand(n, -1).contiguous(),
                                 slots.expand(n, 1).contiguous(), l2p, 1, ex.rank,
                                 ex.cap_rows, ex.W, table, active, counter, flags, 0,
                                 ex.reset_in_kernel)
        torch.cuda.synchronize(ex.device)
        del scratch
        if w13 is not None and w2 is not None:
            self._warm_expert_kernels(w13, w2)

    def _warm_expert_kernels(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        ex = self.exchange
        if not w2.is_contiguous() or w13.dtype != ex.dtype:
            return
        C = max(1, min(8, MAX_ROWS // ex.G))
        try:
            recv0, table, active, counter, flags, scratch = ex.private_state()
            rows, tags = split_rows(recv0[:ex.G * C], ex.H)
            bound = torch.zeros(ex.G, dtype=torch.int32, device=ex.device)
            act = gate_up_rows(w13, rows, tags, rows.new_empty(ex.G * C, w2.shape[2]),
                               tag_bound=(bound, C))
            fused.down_combine_send(act, tags, bound, w2, ex.rank, C, table, active,
                                    counter, flags, 1, ex.reset_in_kernel)
            torch.cuda.synchronize(ex.device)
        except Exception as exc:  # noqa: BLE001 - they then compile at first use instead
            logger.warning("could not compile the decode expert kernels ahead: %s", exc)

    def warm_routed_dispatch(self, logits: torch.Tensor, rule: SoftmaxTopk,
                             logical_to_physical: torch.Tensor, slots_per_rank: int) -> None:
        """Compile the one-token routed dispatch now (once per form), not inside the first
        graph capture. The executor calls it from the warm-up passes before each capture,
        where the rule is first known, with the layer's own map and slot count: Triton
        compiles a form per integer argument equal to 1 and per pointer alignment, so
        stand-ins would compile a form that served steps never use.

        It launches on a private self-only state of ``k`` rows a source (nothing reaches
        a peer, and the memory it takes is a few rows, since the KV cache is already
        sized by then). A failure is logged and left to the capture, which then compiles
        the kernel itself or fails into eager decode as any capture failure does."""
        ex = self.exchange
        key = (rule, logits.shape[1], logits.dtype, slots_per_rank == 1,
               logical_to_physical.data_ptr() % 16 == 0, ex.reset_in_kernel)
        if not ex.cuda or key in self._warm_routes:
            return
        try:
            k = rule.top_k
            _, table, active, counter, flags, scratch = ex.private_state(k)
            hidden = torch.zeros(1, ex.H, dtype=ex.dtype, device=ex.device)
            fused.routed_dispatch(hidden, torch.zeros_like(logits[:1]).contiguous(), rule,
                                  logical_to_physical, slots_per_rank, ex.rank, k, ex.W,
                                  table, active, counter, flags, 0, ex.reset_in_kernel)
            torch.cuda.synchronize(ex.device)
            del scratch
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            logger.warning("could not compile the routed dispatch before the capture: %s", exc)
            return
        self._warm_routes.add(key)

    # ------------------------------------------------------------------ dispatch
    def send_dispatch_static(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                             logical_to_physical: torch.Tensor, slots_per_rank: int, C: int,
                             layer: int) -> IpcHandle:
        """The transport's ``send_dispatch`` for the static dispatch map: each pair goes
        to slot ``logical_to_physical[topk_ids]``. A decode-sized step on CUDA does the
        gather, the plan and the send in one kernel
        (:func:`~elasticep.moe.fused_exchange_kernels.fused_dispatch`).

        Args:
            hidden: [T, H] model dtype; topk_ids: [T, k] int64 logical experts;
            logical_to_physical: [E] int64 (the layer's row of the static dispatch map);
            slots_per_rank: S; C: rows per source block (the step's capacity, the same
                on every rank); layer: decoder layer (a MoE one).

        Returns:
            The exchange's handle, as the transport's ``send_dispatch`` returns it.

        Raises:
            ValueError: ``C`` exceeds the buffers, or ``layer`` does not exchange.
        """
        ex = self.exchange
        ex.check_capacity(C)
        if ex.cuda and self.fused_dispatch and fused.fused_dispatch_ok(hidden, topk_ids):
            position = fused.fused_dispatch(hidden, topk_ids, logical_to_physical,
                                            slots_per_rank, ex.rank, C, ex.W, ex.table,
                                            ex.active, ex.counter, ex.flags,
                                            ex.flag_column(layer), ex.reset_in_kernel)
            return IpcHandle(position, C, hidden.dtype, layer, slots_per_rank)
        slots = logical_to_physical[topk_ids]
        return ex.send_dispatch(hidden, slots, slots_per_rank, C, layer)

    def routes_in_dispatch(self, hidden: torch.Tensor, logits: torch.Tensor,
                           top_k: int) -> bool:
        """Whether :meth:`send_dispatch_routed` routes this step inside its send kernel
        (CUDA, one token: :func:`~elasticep.moe.fused_exchange_kernels.routed_dispatch_ok`)."""
        return self.exchange.cuda and self.fused_dispatch and fused.routed_dispatch_ok(
            hidden, logits, top_k)

    def send_dispatch_routed(self, hidden: torch.Tensor, logits: torch.Tensor,
                             rule: SoftmaxTopk, logical_to_physical: torch.Tensor,
                             slots_per_rank: int, C: int, layer: int
                             ) -> tuple[IpcHandle, torch.Tensor, torch.Tensor]:
        """Route the step's tokens by the softmax top-k ``rule`` and send them as
        :meth:`send_dispatch_static` does. Where :meth:`routes_in_dispatch` holds, one
        kernel does both (:func:`~elasticep.moe.fused_exchange_kernels.routed_dispatch`);
        elsewhere the torch rule (:func:`~elasticep.moe.softmax_topk.softmax_topk_reference`)
        picks the experts first.

        Args:
            hidden: [T, H] model dtype; logits: [T, E] router logits; rule: the layer's
                rule; the rest as :meth:`send_dispatch_static`.

        Returns:
            the handle (as :meth:`send_dispatch_static`), ``topk_ids`` [T, k] int64 and
            ``topk_weights`` [T, k] float32.

        Raises:
            ValueError: ``C`` exceeds the buffers, or ``layer`` does not exchange.
        """
        ex = self.exchange
        ex.check_capacity(C)
        if self.routes_in_dispatch(hidden, logits, rule.top_k):
            position, ids, weights = fused.routed_dispatch(
                hidden, logits, rule, logical_to_physical, slots_per_rank, ex.rank, C, ex.W,
                ex.table, ex.active, ex.counter, ex.flags, ex.flag_column(layer),
                ex.reset_in_kernel)
            return IpcHandle(position, C, hidden.dtype, layer, slots_per_rank), ids, weights
        ids, weights = softmax_topk_reference(logits, rule, hidden.dtype)
        return (self.send_dispatch_static(hidden, ids, logical_to_physical, slots_per_rank,
                                          C, layer), ids, weights)

    # ------------------------------------------------------------------ combine
    def send_combine_down(self, act: torch.Tensor, tags: torch.Tensor, w2: torch.Tensor,
                          handle: IpcHandle) -> None:
        """The transport's ``send_combine`` of the down projection of ``act``, computed in
        the send kernel itself (CUDA;
        :func:`~elasticep.moe.fused_exchange_kernels.down_combine_send`): for a
        decode-sized step, one kernel where the expert compute's second kernel and the
        combine send were two.

        Args:
            act: [G*C, I] model dtype, contiguous: ``silu(gate x) * (up x)`` of the rows
                the transport's ``recv_dispatch`` returned; tags: their raw tags
                (``clamp=False``);
            w2: [S, H, I] contiguous; handle: the exchange's (its dispatch's).

        Raises:
            RuntimeError: on the CPU simulation (it has the plain ``send_combine`` only).
        """
        ex = self.exchange
        if not ex.cuda:
            raise RuntimeError("send_combine_down runs on CUDA only")
        fused.down_combine_send(act, tags, ex.tag_cap(handle.slots_per_rank).view(-1), w2,
                                ex.rank, handle.capacity, ex.table, ex.active, ex.counter,
                                ex.flags, ex.flag_column(handle.layer) + 1,
                                ex.reset_in_kernel)
