"""Expert compute and the EP executor for CUDA: grouped GEMM + fixed-capacity exchange.

:func:`grouped_swiglu` runs the SwiGLU experts of the local slots over rows tagged
with their slot, as two grouped GEMMs (``torch._grouped_mm``: one launch per GEMM for
all slots, offsets computed on the device); where that op is missing or refuses the
inputs it falls back to sorted-by-slot matmuls, which read the slot counts on the
host. :class:`CudaEPMoEExecutor` is the :class:`EPMoEExecutor` whose dispatch and
combine use :mod:`elasticep.moe.padded_exchange`, so a decode step's MoE layers run
without a host-device sync.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.moe.ep_executor import EPMoEExecutor, run_expert_rows
from elasticep.moe.padded_exchange import (
    exchange_over,
    padded_combine,
    padded_dispatch,
    pair_capacity,
)

HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _grouped_ok(x: torch.Tensor, w13: torch.Tensor) -> bool:
    # The fused kernel takes bf16 with 16-byte aligned rows; others use the fallback.
    return (HAS_GROUPED_MM and x.dtype == torch.bfloat16 and w13.dtype == torch.bfloat16
            and x.shape[1] % 8 == 0 and w13.shape[1] % 16 == 0)


def grouped_swiglu(w13: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor,
                   tags: torch.Tensor, use_grouped: bool | None = None) -> torch.Tensor:
    """Unweighted SwiGLU expert output of each tagged row.

    Args:
        w13: [S, 2*I, H] gate rows then up rows (model dtype, rows' device).
        w2: [S, H, I].
        rows: [N, H] model dtype.
        tags: [N] int32/int64, ``local slot + 1``; 0 marks a padding row.
        use_grouped: force (True) or forbid (False) ``torch._grouped_mm``; None picks
            it for bf16 inputs when available.

    Returns:
        [N, H] model dtype: ``w2[s] @ (silu(gate_s x) * (up_s x))`` for a row of slot
        ``s``, zeros for padding rows.
    """
    S = w13.shape[0]
    out = torch.zeros_like(rows)
    if rows.shape[0] == 0:
        return out
    key = torch.where(tags > 0, tags.long() - 1, S)  # padding sorts after every slot
    if use_grouped is None:
        use_grouped = _grouped_ok(rows, w13)
    if not use_grouped:
        valid = torch.nonzero(key < S).squeeze(1)  # host sync: fallback only
        out[valid] = run_expert_rows(w13, w2, rows[valid], key[valid])
        return out
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=S + 1)[:S]
    offs = torch.cumsum(counts, 0).to(torch.int32)  # end row of each slot's group
    x = rows[order]
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    # Rows past the last offset (padding) are left undefined by the kernel.
    y = torch.where((key[order] < S).unsqueeze(1), y, torch.zeros((), dtype=y.dtype,
                                                                  device=y.device))
    out[order] = y
    return out


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
        # An explicit H: view(0, k, -1) is ambiguous for an idle rank's T = 0.
        out = (pairs.view(T, k, hidden_states.shape[1]).float()
               * topk_weights.float().unsqueeze(-1)).sum(1)
        return out.to(hidden_states.dtype)


def make_ep_executor(metadata: ExpertLocationMetadata, w13: list[torch.Tensor | None],
                     w2: list[torch.Tensor | None], group: dist.ProcessGroup | None,
                     dispatch_algorithm: str = "static") -> EPMoEExecutor:
    """The EP executor for where the metadata lives: CUDA -> :class:`CudaEPMoEExecutor`
    (capacity agreed per call unless ``step_max_tokens`` is set), else the CPU
    :class:`EPMoEExecutor`. Raises as they do."""
    cls = CudaEPMoEExecutor if metadata.physical_to_logical_map.is_cuda else EPMoEExecutor
    return cls(metadata, w13, w2, group, dispatch_algorithm=dispatch_algorithm)
