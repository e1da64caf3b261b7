"""The EP executor for CUDA: fixed-capacity exchange + grouped GEMM.

:class:`CudaEPMoEExecutor` is the :class:`EPMoEExecutor` whose dispatch and combine use
:mod:`elasticep.moe.padded_exchange` and whose local experts run as grouped GEMMs
(:func:`elasticep.moe.expert_compute.grouped_swiglu`), so a decode step's MoE layers
run without a host-device sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.expert_compute import combine_pairs, grouped_swiglu
from elasticep.moe.padded_exchange import (
    exchange_over,
    padded_combine,
    padded_dispatch,
    pair_capacity,
)


class CudaEPMoEExecutor(EPMoEExecutor):
    """EP executor for CUDA tensors: fixed-capacity exchange and grouped GEMM.

    Same contract and constructor as :class:`EPMoEExecutor`, plus:

    Args:
        max_tokens: the most tokens any rank passes in one call; sets the exchange
            capacity (:func:`pair_capacity`). Every rank of the group must use the
            same value in every call of a step. The serving step loop sets
            :attr:`step_max_tokens` to the step's agreed maximum (from its header
            all_reduce) around each forward, so no call pays a collective for it.
            None: the ranks agree on it at every call with a MAX all_reduce of a CPU
            int over the group (a host round trip on the CPU side of the group, still
            no device sync).

    Raises:
        ValueError (from ``__call__``): more tokens than ``step_max_tokens``.
    """

    def __init__(self, *args, max_tokens: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_max_tokens = max_tokens
        self._exchange = exchange_over(self.group)

    def _max_tokens(self, T: int) -> int:
        if self.step_max_tokens is not None:
            return self.step_max_tokens
        t = torch.tensor([T], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0])

    def __call__(self, layer_idx: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """Route [T, H] ``hidden_states`` through all ranks' experts (no host sync).

        Shapes and result as :meth:`EPMoEExecutor.__call__`; tensors on the CUDA
        device of the weights. Expert ids are not range-checked (that would sync).
        """
        w13, w2 = self.w13[layer_idx], self.w2[layer_idx]
        if w13 is None or w2 is None:
            raise ValueError(f"layer {layer_idx} has no experts")
        T, k = topk_ids.shape
        max_tokens = self._max_tokens(T)
        if T > max_tokens:
            raise ValueError(f"{T} tokens > step_max_tokens {max_tokens}")
        meta = self.metadata
        S = meta.num_local_physical_experts
        if self.dispatch_algorithm == "static":
            slots = meta.logical_to_rank_dispatch_physical_map[layer_idx][topk_ids]
        else:  # the same round robin as the CPU path, on the device
            n = meta.logical_to_all_physical_map_num_valid[layer_idx][topk_ids]
            pick = (torch.arange(T * k, device=topk_ids.device).view(T, k) + meta.ep_rank) % n
            slots = meta.logical_to_all_physical_map[layer_idx][topk_ids, pick]
        cap = pair_capacity(max_tokens, k, S)
        rows, tags, plan = padded_dispatch(hidden_states, slots, S, meta.max_ep_size, cap,
                                           self._exchange)
        pairs = padded_combine(grouped_swiglu(w13, w2, rows, tags), plan, self._exchange)
        return combine_pairs(pairs, topk_weights, hidden_states.dtype)


def make_ep_executor(metadata: ExpertLocationMetadata, w13: list[torch.Tensor | None],
                     w2: list[torch.Tensor | None], group: dist.ProcessGroup | None,
                     dispatch_algorithm: str = "static") -> EPMoEExecutor:
    """The EP executor for where the metadata lives: CUDA -> :class:`CudaEPMoEExecutor`
    (capacity agreed per call unless ``step_max_tokens`` is set), else the CPU
    :class:`EPMoEExecutor`. Raises as they do."""
    cls = CudaEPMoEExecutor if metadata.physical_to_logical_map.is_cuda else EPMoEExecutor
    return cls(metadata, w13, w2, group, dispatch_algorithm=dispatch_algorithm)
