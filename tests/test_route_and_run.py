"""The MoE block's offer of router logits to its executor (``route_and_run``), on CPU.

The fused rule only exists on CUDA (the kernels' condition), so these tests stand in a
rule for the block and check the wiring: an executor that routes is used alone, one that
declines (the default) gets the ids and weights the block routes itself, and the hooks
wrapper declines while a hook must see each layer's ids.
"""

from __future__ import annotations

import torch

from elasticep.elastic.rank_model import HookedExecutor
from elasticep.models import moe_block as mb
from elasticep.models.routing import RoutingConfig, route
from elasticep.moe.executor import ExecutorDefaults
from elasticep.moe.softmax_topk import SoftmaxTopk

T, H, E, K = 3, 8, 6, 2


class _Executor(ExecutorDefaults):
    """Records its calls; routes itself when ``routes`` (returns a marked tensor)."""

    def __init__(self, routes: bool) -> None:
        self.routes, self.calls, self.offers = routes, [], []

    def __call__(self, layer_idx, hidden_states, topk_ids, topk_weights):
        self.calls.append((layer_idx, topk_ids.clone(), topk_weights.clone()))
        return torch.zeros_like(hidden_states)

    def route_and_run(self, layer_idx, hidden_states, logits, rule):
        self.offers.append((layer_idx, logits.clone(), rule))
        return torch.full_like(hidden_states, 7.0) if self.routes else None


def _block(monkeypatch, executor, rule: SoftmaxTopk | None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    w = mb.MoEBlockWeights(router=torch.randn(E, H, generator=g))
    cfg = RoutingConfig(num_experts=E, top_k=K, norm_topk_prob=True)
    monkeypatch.setattr(mb, "fused_rule", lambda logits, routing: rule)
    return x, w, cfg, mb.moe_block(4, x, w, executor, cfg)


def test_an_executor_that_routes_gets_the_logits_and_is_not_called(monkeypatch):
    ex = _Executor(routes=True)
    rule = SoftmaxTopk(K, True)
    x, w, _, out = _block(monkeypatch, ex, rule)
    assert torch.equal(out, torch.full_like(x, 7.0)) and not ex.calls
    (layer, logits, got_rule), = ex.offers
    assert layer == 4 and got_rule == rule
    assert torch.allclose(logits, torch.nn.functional.linear(x, w.router))


def test_a_declining_executor_is_called_with_the_blocks_own_routing(monkeypatch):
    ex = _Executor(routes=False)
    x, w, cfg, _ = _block(monkeypatch, ex, SoftmaxTopk(K, True))
    assert len(ex.offers) == 1
    (layer, ids, weights), = ex.calls
    want_ids, want_w = route(x, w.router, cfg)
    assert layer == 4 and torch.equal(ids, want_ids) and torch.equal(weights, want_w)


def test_no_rule_no_offer(monkeypatch):
    ex = _Executor(routes=True)
    _block(monkeypatch, ex, None)
    assert not ex.offers and len(ex.calls) == 1


def test_the_hooks_wrapper_declines_while_a_hook_is_set():
    inner = _Executor(routes=True)
    x, logits = torch.randn(1, H), torch.randn(1, E)
    rule = SoftmaxTopk(K)
    hooked = HookedExecutor(inner)
    assert torch.equal(hooked.route_and_run(0, x, logits, rule), torch.full_like(x, 7.0))
    hooked.hooks.append(lambda layer, ids: None)
    assert hooked.route_and_run(1, x, logits, rule) is None
    assert [o[0] for o in inner.offers] == [0]  # the inner one was not asked again
