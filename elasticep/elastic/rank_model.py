"""One rank's model: non-expert weights, its local expert slots, and the EP executor.

The model's MoE blocks call ``model.executor``; here that is a :class:`HookedExecutor`
around the rank's :class:`EPMoEExecutor` (dispatch/combine over the WORLD group), so
the step loop can observe each MoE layer (fault injection, EPLB counts) without the
models layer knowing about either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from elasticep.elastic.step_header import agreed_max_tokens
from elasticep.eplb import ExpertLocationMetadata, Placement
from elasticep.models import MoECausalLM, load_expert_into_slot, load_model
from elasticep.models.expert_loader import alloc_expert_slots, experts_fp8
from elasticep.models.weight_source import open_weights
from elasticep.moe.cuda_executor import make_ep_executor
from elasticep.moe.ep_executor import EPMoEExecutor
from elasticep.moe.executor import ExecutorDefaults
from elasticep.moe.softmax_topk import SoftmaxTopk
from elasticep.utils.graph_boundary import eager_boundary, replay_rows

# hook(layer_idx, topk_ids [T, k] int64) called before each MoE layer's dispatch
LayerHook = Callable[[int, torch.Tensor], None]


class CheckpointExperts:
    """``load_fn(layer, expert) -> (w13 [2*I, H], w2 [H, I])`` read from the checkpoint
    (for FP8 experts, the packed slot rows with their scales, as the model holds them).

    The reader stays open for the worker's life (safetensors maps files lazily), so an
    orphan reload after a failure pays no index parsing.

    Args:
        model: the rank's model (for its config, dtype and device).
        model_dir: the checkpoint directory.
        load_format: as :func:`elasticep.models.weight_source.open_weights`; with "dummy" an
            orphan is drawn again from ``seed``, bit-identical to its lost copy.
        seed: the dummy weights' seed.
        quantization: the deployment's ``--quantization`` (an orphan is rounded through
            FP8 exactly as at launch).
    """

    def __init__(self, model: MoECausalLM, model_dir: str | Path, load_format: str = "auto",
                 seed: int = 0, quantization: str | None = None) -> None:
        self.config = model.config
        self.dtype, self.device = model.dtype, model.device
        self.reader = open_weights(model_dir, load_format, seed, model.config, quantization)
        self.fp8 = experts_fp8(self.reader, model.config)  # packed slots, as the model's
        self.num_loaded = 0

    def __call__(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        n = c.num_hidden_layers
        slots = alloc_expert_slots(c, torch.zeros(n, 1, dtype=torch.long), self.dtype,
                                   self.device, self.fp8)
        slots.w13 = [w if i == layer else None for i, w in enumerate(slots.w13)]
        slots.w2 = [w if i == layer else None for i, w in enumerate(slots.w2)]
        load_expert_into_slot(self.reader, c, slots, layer, 0, expert)
        self.num_loaded += 1
        return slots.w13[layer][0], slots.w2[layer][0]

    def close(self) -> None:
        self.reader.close()


class HookedExecutor(ExecutorDefaults):
    """The executor contract (docs/ARCHITECTURE.md) with hooks run before each layer.

    Hooks are Python (a fault injector, EPLB's counters), so each runs at an eager
    boundary: in a captured decode graph it still runs at every replay, with the layer's
    ``topk_ids`` of that step, and never at capture time. At a replay a hook sees the
    step's rows only, not the rows that pad the batch to its bucket
    (:func:`~elasticep.utils.graph_boundary.replay_rows`): those route too, and EPLB
    would count them as expert load.

    Args:
        inner: the EP executor doing the work.
        hooks: called as ``hook(layer_idx, topk_ids)`` before the dispatch.
    """

    def __init__(self, inner: EPMoEExecutor, hooks: list[LayerHook] | None = None) -> None:
        self.inner = inner
        self.hooks = list(hooks or [])

    def __call__(self, layer_idx: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        for hook in self.hooks:
            eager_boundary(lambda hook=hook: hook(layer_idx, _step_rows(topk_ids)))
        return self.inner(layer_idx, hidden_states, topk_ids, topk_weights)

    def route_and_run(self, layer_idx: int, hidden_states: torch.Tensor, logits: torch.Tensor,
                      rule: SoftmaxTopk) -> torch.Tensor | None:
        """The inner executor's fused routing, while no hook is set (a hook reads the
        layer's ``topk_ids`` before the dispatch, which routing inside it would not
        give)."""
        if self.hooks:
            return None
        return self.inner.route_and_run(layer_idx, hidden_states, logits, rule)

    @property
    def graph_safe(self) -> bool:
        return self.inner.graph_safe


def _step_rows(per_token: torch.Tensor) -> torch.Tensor:
    """``per_token``'s rows that hold the step's tokens (all of them outside a replay)."""
    rows = replay_rows()
    return per_token if rows is None else per_token[:rows]


def load_rank_weights(model_dir: str | Path, placement: Placement, rank: int,
                      dtype: torch.dtype, device: str = "cpu",
                      with_experts: bool = True, load_format: str = "auto",
                      seed: int = 0, quantization: str | None = None) -> MoECausalLM:
    """Load this rank's share of the model: every non-expert weight plus its local slots.

    Needs no process group, so a worker loads before it joins the group (a long load
    then owes the coordinator no heartbeats).

    Args:
        model_dir: HF checkpoint directory.
        placement: the current placement; this rank loads ``placement.local(rank)``.
        rank: this rank (global slot id).
        dtype: model dtype.
        device: where the weights live; "cuda" picks GPU ``rank % device_count`` and
            makes it (or an explicit "cuda:N") the current device, which the rank's
            NCCL communicators use.
        with_experts: False on a joiner: it loads no expert (see :func:`attach_ep_executor`).
        load_format, seed, quantization: where weights come from and how they are
            quantized (:func:`elasticep.models.weight_source.open_weights`).

    Raises:
        ValueError: bad checkpoint or placement.
    """
    local = placement.local(rank) if with_experts else placement.local(rank)[:, :0]
    if device.startswith("cuda"):  # one GPU per rank (NCCL refuses two ranks on one GPU)
        torch.cuda.set_device(rank % torch.cuda.device_count() if device == "cuda" else device)
        device = f"cuda:{torch.cuda.current_device()}"
    return load_model(model_dir, dtype=dtype, device=device, slot_to_logical=local, progress=False,
                      load_format=load_format, seed=seed, quantization=quantization)


def attach_ep_executor(model: MoECausalLM, placement: Placement, rank: int,
                       group: dist.ProcessGroup | None, dispatch_algorithm: str
                       ) -> tuple[EPMoEExecutor, HookedExecutor]:
    """Plug an EP executor over ``group`` into ``model`` (``model.executor`` = the hooked one).

    A model loaded without experts (a joiner) gets zero-filled slots under the stand-in
    ``placement``; both are replaced once it is admitted
    (:func:`elasticep.elastic.placement_sync.share_placement`).

    Raises:
        ValueError: the group's size is not ``placement.max_ep_size``.
    """
    w13, w2 = model.experts.w13, model.experts.w2
    S = placement.slots_per_rank
    if model.experts.num_slots != S:
        w13 = [None if a is None else a.new_zeros(S, *a.shape[1:]) for a in w13]
        w2 = [None if b is None else b.new_zeros(S, *b.shape[1:]) for b in w2]
    meta = ExpertLocationMetadata.from_placement(placement, rank, model.device)
    ep = make_ep_executor(meta, w13, w2, group, dispatch_algorithm=dispatch_algorithm)
    hooked = HookedExecutor(ep)
    model.executor = hooked
    return ep, hooked


def warmup_step_context(model: MoECausalLM, ep: EPMoEExecutor
                        ) -> Callable[[int], AbstractContextManager]:
    """``around(num_tokens)`` for :func:`elasticep.engine.prefill_warmup.warm_up_prefill`:
    a dummy step on this rank alone, in the shapes a real step of ``num_tokens`` has.

    Within it the executor's token bound is ``num_tokens`` (as the step loop's header
    would agree for a step whose largest batch is this one), every token exchange is a
    local copy of what would be sent (the executor's ``local_exchange()``: the padded
    exchange's shapes, no peer and no shared buffer involved, so ranks warm up each on
    its own schedule, joiners included), and the layer hooks (EPLB's counts, injected
    faults) do not see the dummy tokens. An executor without ``local_exchange`` (the CPU
    one, which the warm-up never runs) is used as is.
    """

    @contextmanager
    def around(num_tokens: int) -> Iterator[None]:
        hooked = model.executor
        model.executor = ep
        try:
            with agreed_max_tokens(ep, num_tokens), ep.local_exchange():
                yield
        finally:
            model.executor = hooked

    return around
