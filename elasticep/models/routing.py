"""Top-k routing over logical experts, for every family we serve.

Qwen2/3-MoE and Mixtral take the top k of a softmax. DeepSeek adds expert groups
(``n_group``, ``topk_group``): V2 keeps the experts of the best groups by their top
score (``group_limited_greedy``); V3 scores with a sigmoid, adds the load-balancing
``e_score_correction_bias`` for the choice only, and ranks groups by the sum of their
two best scores (``noaux_tc``, DeepSeek-V3 report sec. 2.1.2). The chosen weights may
be renormalised (``norm_topk_prob``) and are multiplied by ``routed_scaling_factor``.
Formulas follow the transformers DeepseekV2/V3 routers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elasticep.models.fused_routing import fused_route_ok, fused_softmax_topk
from elasticep.moe.softmax_topk import SoftmaxTopk, finish_weights

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    """How a MoE layer picks its experts.

    Attributes:
        num_experts: E logical routed experts.
        top_k: experts per token.
        scoring_func: ``softmax`` or ``sigmoid``.
        topk_method: ``greedy``, ``group_limited_greedy`` or ``noaux_tc``.
        n_group, topk_group: experts form ``n_group`` equal groups; only the best
            ``topk_group`` groups compete (grouped methods only).
        norm_topk_prob: renormalise the k weights to sum to 1.
        routed_scaling_factor: multiplies the final weights.
        fp32_logits: compute the router matmul in float32 (DeepSeek keeps its gate in
            fp32; the Qwen families use the model dtype).
    """

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    fp32_logits: bool = False

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported ({', '.join(SCORING_FUNCS)})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not supported ({', '.join(TOPK_METHODS)})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")
        if self.topk_method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_group {self.n_group} must divide n_routed_experts {self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")


def _keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, cfg: RoutingConfig,
                      fill: float) -> torch.Tensor:
    """Set every expert outside the ``topk_group`` best groups to ``fill``.

    scores ``[T, E]``, group_scores ``[T, n_group]`` -> ``[T, E]``.
    """
    best = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep.repeat_interleave(cfg.num_experts // cfg.n_group, dim=1)
    return scores.masked_fill(~keep, fill)


def route(
    hidden_states: torch.Tensor,
    router: torch.Tensor,
    cfg: RoutingConfig,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``cfg.top_k`` experts per token and their combine weights.

    Args:
        hidden_states: ``[T, H]`` model dtype.
        router: ``[E, H]`` gate weight.
        cfg: the layer's routing rule.
        correction_bias: ``[E]`` float32 ``e_score_correction_bias`` (``noaux_tc`` only;
            it steers the choice, never the weights).

    Returns:
        ``topk_ids [T, k]`` int64 logical ids, ``topk_weights [T, k]`` float32.

    Raises:
        ValueError: ``noaux_tc`` without a correction bias.
    """
    return route_logits(router_logits(hidden_states, router, cfg), cfg, hidden_states.dtype,
                        correction_bias)


def router_logits(hidden_states: torch.Tensor, router: torch.Tensor,
                  cfg: RoutingConfig) -> torch.Tensor:
    """``[T, E]`` router logits of ``hidden_states [T, H]``: float32 where the family
    keeps its gate in float32 (``fp32_logits``), else the model dtype."""
    if cfg.fp32_logits:
        return F.linear(hidden_states.float(), router.float())
    return F.linear(hidden_states, router)


def fused_rule(logits: torch.Tensor, cfg: RoutingConfig) -> SoftmaxTopk | None:
    """The rule as an executor's fused routing takes it (``route_and_run``), where the
    fused kernels implement it for these ``logits`` (from :func:`router_logits`); else
    None. Those kernels pick what :func:`route_logits` picks for them, bit for bit."""
    if cfg.fp32_logits or not fused_route_ok(logits, cfg.scoring_func, cfg.topk_method,
                                             cfg.top_k):
        return None
    return SoftmaxTopk(cfg.top_k, cfg.norm_topk_prob, cfg.routed_scaling_factor)


def route_logits(logits: torch.Tensor, cfg: RoutingConfig, model_dtype: torch.dtype,
                 correction_bias: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` from the router logits (``[T, E]``, from :func:`router_logits`);
    ``model_dtype``: the hidden states' dtype (the weights are rounded through it).
    Returns and raises as :func:`route`."""
    if not cfg.fp32_logits:
        if fused_route_ok(logits, cfg.scoring_func, cfg.topk_method, cfg.top_k):
            return fused_softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob,
                                      cfg.routed_scaling_factor, model_dtype)
        logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if cfg.scoring_func == "softmax" else torch.sigmoid(logits)
    t, per_group = scores.shape[0], cfg.num_experts // cfg.n_group  # t is 0 on an idle EP rank
    if cfg.topk_method == "greedy":
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1)
    elif cfg.topk_method == "group_limited_greedy":
        group_scores = scores.view(t, cfg.n_group, per_group).max(dim=-1).values
        weights, ids = torch.topk(_keep_best_groups(scores, group_scores, cfg, 0.0), cfg.top_k, dim=-1)
    else:
        if correction_bias is None:
            raise ValueError("topk_method 'noaux_tc' needs mlp.gate.e_score_correction_bias")
        choice = scores + correction_bias.float()
        group_scores = choice.view(t, cfg.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        ids = torch.topk(_keep_best_groups(choice, group_scores, cfg, float("-inf")), cfg.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    return ids, finish_weights(weights, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                               model_dtype)
