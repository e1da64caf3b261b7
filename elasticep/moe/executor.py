"""What a model's MoE layers call: the :class:`ExpertExecutor` protocol, and the defaults
of its optional capabilities (:class:`ExecutorDefaults`).

Callers read capabilities as attributes, never by probing for them (``hasattr``): an
executor that lacks a feature says so with the default value.

* ``graph_safe`` (bool): the forward has no host sync and every collective, if any, runs
  through an eager boundary, so the decode forward may be captured in a CUDA graph
  (:mod:`elasticep.engine.cuda_graph`).
* ``version`` (int): bumped when a tensor the graphs read changes storage; a graph
  captured at another version is stale.
* ``uses_step_bound`` (bool) and ``step_max_tokens`` (int | None): the executor sizes its
  exchange from the step's agreed largest batch, which the step loop sets around each
  forward (:func:`elasticep.elastic.step_header.agreed_max_tokens`).
* ``local_exchange()``: a context in which no peer is involved (warm-up steps,
  :mod:`elasticep.engine.prefill_warmup`); a no-op where nothing is exchanged.
* ``token_buckets`` (tuple of int, or None): the decode CUDA graphs' batch sizes, set by
  the model runner; an EP executor rounds its exchange up to them.
* ``refresh()``: rebuild what the executor derives from its slots after they changed
  (a no-op where nothing is derived).
* ``graph_variants`` (tuple of str or None) and ``graph_variant()``: the forms of the
  decode forward the CUDA graphs capture per bucket, and which of them a replay must use
  now. ``(None,)`` and None where there is one form; the same-host exchange adds
  ``"solo"``, its forward without waits for peers, valid while no peer is active.
* ``route_and_run(layer_idx, hidden_states, logits, rule)``: the layer from its router
  logits, with the softmax top-k ``rule`` (:class:`~elasticep.moe.softmax_topk.SoftmaxTopk`)
  applied inside the executor's own kernels; None where the executor does not do that
  for this call, and the caller routes and calls it as usual. The same-host exchange
  routes a one-token step inside its dispatch send (one kernel a layer fewer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch

from elasticep.moe.softmax_topk import SoftmaxTopk


class ExpertExecutor(Protocol):
    """The MoE layer contract (docs/ARCHITECTURE.md, "MoE layer") with its capabilities.

    ``executor(layer_idx, hidden_states [T, H], topk_ids [T, k] int64, topk_weights
    [T, k] float32) -> [T, H]`` in the hidden states' dtype.
    """

    graph_safe: bool
    version: int
    uses_step_bound: bool
    step_max_tokens: int | None
    token_buckets: tuple[int, ...] | None
    graph_variants: tuple[str | None, ...]

    def graph_variant(self) -> str | None: ...

    def __call__(self, layer_idx: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor: ...

    def local_exchange(self) -> contextlib.AbstractContextManager: ...

    def refresh(self) -> None: ...

    def route_and_run(self, layer_idx: int, hidden_states: torch.Tensor, logits: torch.Tensor,
                      rule: SoftmaxTopk) -> torch.Tensor | None: ...


class ExecutorDefaults:
    """The capabilities of an executor that has none of them (mixed into every executor)."""

    graph_safe = False
    version = 0
    uses_step_bound = False
    step_max_tokens: int | None = None
    token_buckets: tuple[int, ...] | None = None
    graph_variants: tuple[str | None, ...] = (None,)

    def graph_variant(self) -> str | None:
        """One form of the forward: the plain one."""
        return None

    def refresh(self) -> None:
        """Nothing derived from the slots: nothing to rebuild."""

    def route_and_run(self, layer_idx: int, hidden_states: torch.Tensor, logits: torch.Tensor,
                      rule: SoftmaxTopk) -> torch.Tensor | None:
        """No routing of its own: None (the caller routes)."""
        return None

    @contextlib.contextmanager
    def local_exchange(self) -> Iterator[None]:
        """Nothing to keep local: the body runs as it is."""
        yield
