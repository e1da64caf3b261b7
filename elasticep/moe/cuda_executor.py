"""The EP executor for CUDA: fixed-capacity exchange + grouped GEMM.

:class:`CudaEPMoEExecutor` is the :class:`EPMoEExecutor` whose dispatch and combine use
:mod:`elasticep.moe.exchange.padded_exchange` and whose local experts run as grouped GEMMs
(:func:`elasticep.moe.experts.expert_compute.grouped_swiglu`), so a decode step's MoE layers
run without a host-device sync.

It is also what makes EP decode capturable in CUDA graphs
(:mod:`elasticep.engine.cuda_graph`): each all_to_all is an eager boundary
(:func:`elasticep.utils.graph_boundary.eager_boundary`) over persistent buffers, and a
new placement of the same shape is copied into the tensors the graphs already point to.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from elasticep.config import DispatchAlgorithm
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.exchange.ipc_exchange import SOLO, IpcExchange, IpcHandle
from elasticep.moe.exchange.padded_exchange import (
    ExchangeBuffers,
    exchange_over,
    fresh,
    padded_combine,
    padded_dispatch,
    pair_capacity,
)
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.small_batch_experts import gate_up_rows, small_batch_ok
from elasticep.moe.fused_exchange import FusedForms
from elasticep.moe.softmax_topk import SoftmaxTopk
from elasticep.utils.graph_boundary import capture_bound, capturing, eager_boundary


def _same_shapes(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                      and x.dtype == y.dtype and x.device == y.device)
        for x, y in zip(a, b, strict=True))


def _device_fields(meta: ExpertLocationMetadata) -> list[str]:
    return [f.name for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor) and not f.name.endswith("_cpu")]


class CudaEPMoEExecutor(EPMoEExecutor):
    """EP executor for CUDA tensors: fixed-capacity exchange and grouped GEMM.

    Same contract and constructor as :class:`EPMoEExecutor`, plus:

    Args:
        max_tokens: the most tokens any rank passes in one call; sets the exchange
            capacity (:func:`pair_capacity`). Every rank of the group must use the
            same value in every call of a step. The serving step loop sets
            :attr:`step_max_tokens` to the step's agreed maximum (from its header
            all_reduce) around each forward, so no call pays a collective for it. A
            graph capture sizes the exchange for its bucket instead
            (:func:`~elasticep.utils.graph_boundary.capture_bound`).
            None: the ranks agree on it at every call with a MAX all_reduce of a CPU
            int over the group (a host round trip on the CPU side of the group, still
            no device sync).

    Attributes:
        token_buckets: ascending batch sizes of the decode CUDA graphs (set by the model
            runner, the same on every rank), or None. With buckets, the exchange is
            sized for the smallest bucket holding the step's bound, so a rank that
            replays a graph and one that runs eagerly exchange buffers of one size.
        version: bumped when a placement changes a tensor's shape (or the exchange
            buffers move): graphs captured before point to stale storage.
        graph_safe: True: no host sync, and every collective is an eager boundary.

    Raises:
        ValueError (from ``__call__``): more tokens than ``step_max_tokens``.
    """

    graph_safe = True
    uses_step_bound = True

    def __init__(self, *args, max_tokens: int | None = None, **kwargs) -> None:
        # set before the base constructor, whose set_placement reads them
        self._shape_version = 0
        self._placed = False  # a placement was set: graphs may point to its tensors
        self._transport: IpcExchange | None = None
        self._fused: FusedForms | None = None  # the transport's fused sends
        super().__init__(*args, **kwargs)
        self.step_max_tokens = max_tokens
        self.token_buckets: tuple[int, ...] | None = None
        self._exchange = exchange_over(self.group)
        self._buffers = ExchangeBuffers(capturing)
        self._local_only = False

    @property
    def transport(self) -> IpcExchange | None:
        """The same-host exchange the MoE layers use (``--moe-a2a-backend cuda_ipc``), or
        None for the padded all_to_all over the group. Set it before any graph capture:
        setting it prepares the exchange's tensors for the current placement."""
        return self._transport

    @transport.setter
    def transport(self, exchange: IpcExchange | None) -> None:
        fused = None
        if exchange is not None:
            exchange.tag_cap(self.metadata.num_local_physical_experts)
            fused = FusedForms(exchange)
            layer = next((i for i, w in enumerate(self.w13) if w is not None), None)
            fused.warm(*((self.w13[layer], self.w2[layer]) if layer is not None else ()))
        self._transport, self._fused = exchange, fused

    @property
    def graph_variants(self) -> tuple[str | None, ...]:
        """The decode forwards to capture per bucket: the plain one, and with a transport
        that has peer slots, its :data:`~elasticep.moe.exchange.ipc_exchange.SOLO` form."""
        t = self._transport
        return (None, SOLO) if t is not None and t.G > 1 else (None,)

    def graph_variant(self) -> str | None:
        """The form a decode replay must use now: ``SOLO`` while the transport's
        membership has no peer, else the plain one."""
        t = self._transport
        return SOLO if t is not None and t.G > 1 and t.solo else None

    @contextlib.contextmanager
    def local_exchange(self) -> Iterator[None]:
        """Within: every token exchange is a local copy of what would be sent (the padded
        layout's shapes, no peer involved, the transport's shared buffers untouched), for
        a rank's warm-up steps on its own schedule (:mod:`elasticep.engine.prefill_warmup`)."""
        saved, self._exchange, self._local_only = self._exchange, _local_copy, True
        try:
            yield
        finally:
            self._exchange, self._local_only = saved, False

    @property
    def version(self) -> int:
        return self._shape_version + self._buffers.generation

    def set_placement(self, metadata: ExpertLocationMetadata, w13: list[torch.Tensor | None],
                      w2: list[torch.Tensor | None]) -> None:
        """As :meth:`EPMoEExecutor.set_placement`; a placement whose tensors have the
        shapes of the current one is copied into the current tensors (captured graphs
        stay valid), any other bumps :attr:`version`. Raises as the base method does.

        The copy briefly holds both sets of expert weights (the new ones were fetched
        before this call).
        """
        if self._transport is not None:
            self._transport.tag_cap(metadata.num_local_physical_experts)
        if not self._placed:  # the first placement: nothing to keep
            super().set_placement(metadata, w13, w2)
            self._placed = True
            self._shape_version += 1
            return
        old, old13, old2 = self.metadata, self.w13, self.w2
        super().set_placement(metadata, w13, w2)
        fields = _device_fields(metadata)
        if (not _same_shapes(old13, self.w13) or not _same_shapes(old2, self.w2)
                or not _same_shapes([getattr(old, f) for f in fields],
                                    [getattr(metadata, f) for f in fields])):
            self._shape_version += 1
            return
        for kept, new in [*zip(old13, self.w13, strict=True), *zip(old2, self.w2, strict=True)]:
            if kept is not None and kept is not new:
                kept.copy_(new)
        self.w13, self.w2 = old13, old2
        self.metadata = dataclasses.replace(
            metadata, **{f: getattr(old, f).copy_(getattr(metadata, f)) for f in fields})

    def _checked_bound(self, layer_idx: int, T: int) -> int:
        # the step's token bound for a call of T tokens on a layer that has experts
        if self.w13[layer_idx] is None or self.w2[layer_idx] is None:
            raise ValueError(f"layer {layer_idx} has no experts")
        max_tokens = self._max_tokens(T)
        if T > max_tokens:
            raise ValueError(f"{T} tokens > step_max_tokens {max_tokens}")
        return max_tokens

    def _max_tokens(self, T: int) -> int:
        bucket = capture_bound()
        if bucket is not None:  # a graph capture sizes the exchange for its bucket
            return bucket
        if self.step_max_tokens is not None:
            n = self.step_max_tokens
        else:
            t = torch.tensor([T], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            n = int(t[0])
        if self.token_buckets:
            n = next((b for b in self.token_buckets if b >= n), n)
        return n

    def _exchange_boundary(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        # At capture the peers are not involved: a local copy stands in for the exchange.
        eager_boundary(lambda: self._exchange(out, inp), at_capture=lambda: out.copy_(inp))

    def __call__(self, layer_idx: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """Route [T, H] ``hidden_states`` through all ranks' experts (no host sync).

        Shapes and result as :meth:`EPMoEExecutor.__call__`; tensors on the CUDA
        device of the weights. Expert ids are not range-checked (that would sync).
        """
        T, k = topk_ids.shape
        max_tokens = self._checked_bound(layer_idx, T)
        meta = self.metadata
        S = meta.num_local_physical_experts
        on_transport = (self._transport is not None and not self._local_only
                        and not (capturing() and not _stream_capturing()))
        if on_transport and self.dispatch_algorithm == "static":
            cap = pair_capacity(max_tokens, k, S)
            return self._via_transport(layer_idx, hidden_states, topk_ids, topk_weights, cap)
        if self.dispatch_algorithm == "static":
            slots = meta.logical_to_rank_dispatch_physical_map[layer_idx][topk_ids]
        else:  # the same round robin as the CPU path, on the device
            n = meta.logical_to_all_physical_map_num_valid[layer_idx][topk_ids]
            pick = (torch.arange(T * k, device=topk_ids.device).view(T, k) + meta.ep_rank) % n
            slots = meta.logical_to_all_physical_map[layer_idx][topk_ids, pick]
        cap = pair_capacity(max_tokens, k, S)
        if on_transport:
            return self._via_transport(layer_idx, hidden_states, topk_ids, topk_weights, cap,
                                       slots)
        # Graph pieces and the eager exchanges between them meet in persistent buffers;
        # an eager step allocates its own, so it never touches what a graph points to
        # (a capture may run in a background thread meanwhile).
        bufs = self._buffers if capturing() else fresh
        rows, tags, handle = padded_dispatch(hidden_states, slots, S, meta.max_ep_size, cap,
                                             self._exchange_boundary, bufs)
        expert_out = grouped_swiglu(self.w13[layer_idx], self.w2[layer_idx], rows, tags,
                                    sync_free=True, out=bufs("expert_out", rows.shape[0], rows))
        return padded_combine(expert_out, handle, topk_weights, self._exchange_boundary, bufs)

    def route_and_run(self, layer_idx: int, hidden_states: torch.Tensor,
                      logits: torch.Tensor, rule: SoftmaxTopk) -> torch.Tensor | None:
        """Route a one-token step inside the same-host exchange's dispatch send, then run
        the layer as ``__call__`` does; None where that does not apply (the caller then
        routes and calls ``__call__``), decided from shapes and settings alone.

        It applies to a step of one token on the transport (CUDA) with the static
        dispatch map: the router's own kernel is not launched, so a decode layer runs
        one kernel fewer (:func:`~elasticep.moe.fused_exchange_kernels.routed_dispatch`).

        Args:
            hidden_states: [T, H] model dtype; logits: [T, E] router logits of the
                layer, model dtype; rule: the layer's softmax top-k rule (the caller
                vouches that it is the model's routing).

        Returns:
            [T, H] model dtype, as ``__call__``, or None.
        """
        t = self._fused
        if (t is None or self._local_only or self.dispatch_algorithm != "static"
                or not t.routes_in_dispatch(hidden_states, logits, rule.top_k)):
            return None
        S = self.metadata.num_local_physical_experts
        l2p = self.metadata.logical_to_rank_dispatch_physical_map[layer_idx]
        if capturing() and not _stream_capturing():
            # a warm-up pass before a capture, which takes the padded path's local
            # stand-in: the routed send is compiled here, not inside the capture
            t.warm_routed_dispatch(logits, rule, l2p, S)
            return None
        cap = pair_capacity(self._checked_bound(layer_idx, 1), rule.top_k, S)
        handle, _, weights = t.send_dispatch_routed(hidden_states, logits, rule, l2p, S, cap,
                                                    layer_idx)
        return self._experts_and_combine(layer_idx, handle, weights)

    def _via_transport(self, layer_idx: int, hidden_states: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor, cap: int,
                       slots: torch.Tensor | None = None) -> torch.Tensor:
        # The same-host exchange: no collective, so a graph capture holds the whole layer.
        # (Warm-up passes before a capture take the padded path's local stand-in above.)
        # ``slots``: the dynamic dispatch's choice; None: the static map's, gathered by
        # the send itself.
        t, S = self.transport, self.metadata.num_local_physical_experts
        if slots is None:
            l2p = self.metadata.logical_to_rank_dispatch_physical_map[layer_idx]
            handle = self._fused.send_dispatch_static(hidden_states, topk_ids, l2p, S, cap,
                                                      layer_idx)
        else:
            handle = t.send_dispatch(hidden_states, slots, S, cap, layer_idx)
        return self._experts_and_combine(layer_idx, handle, topk_weights)

    def _experts_and_combine(self, layer_idx: int, handle: IpcHandle,
                             topk_weights: torch.Tensor) -> torch.Tensor:
        # after the dispatch send: the received rows through the local experts, back to
        # their sources, and this rank's pairs combined
        t = self.transport
        # the tags' clamp to the sources' bounds is left to the expert kernels
        rows, tags = t.recv_dispatch(handle, clamp=False)
        w13, w2 = self.w13[layer_idx], self.w2[layer_idx]
        bound = (t.tag_cap(handle.slots_per_rank), handle.capacity)
        if t.cuda and w2.is_contiguous() and small_batch_ok(rows, w13):
            # decode sizes: the down projection writes the sources' combine rows itself
            act = gate_up_rows(w13, rows, tags, rows.new_empty(rows.shape[0], w2.shape[2]),
                               tag_bound=bound)
            self._fused.send_combine_down(act, tags, w2, handle)
        else:
            bufs = self._buffers if capturing() else fresh
            expert_out = grouped_swiglu(w13, w2, rows, tags, sync_free=True,
                                        out=bufs("expert_out", rows.shape[0], rows),
                                        tag_bound=bound)
            t.send_combine(expert_out, handle)
        return t.finish_combine(handle, topk_weights)


def _local_copy(out: torch.Tensor, inp: torch.Tensor) -> None:
    out.copy_(inp)


def _stream_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def make_ep_executor(metadata: ExpertLocationMetadata, w13: list[torch.Tensor | None],
                     w2: list[torch.Tensor | None], group: dist.ProcessGroup | None,
                     dispatch_algorithm: DispatchAlgorithm = DispatchAlgorithm.STATIC
                     ) -> EPMoEExecutor:
    """The EP executor for where the metadata lives: CUDA -> :class:`CudaEPMoEExecutor`
    (capacity agreed per call unless ``step_max_tokens`` is set), else the CPU
    :class:`EPMoEExecutor`. Raises as they do."""
    cls = CudaEPMoEExecutor if metadata.physical_to_logical_map.is_cuda else EPMoEExecutor
    return cls(metadata, w13, w2, group, dispatch_algorithm=dispatch_algorithm)
