"""EPLBManager: count routed tokens over a sliding window and rebalance periodically.

The manager decides; it moves no weight itself. A step loop calls :meth:`record` from
each MoE layer, :meth:`step` once per step, and when that returns True (on every rank at
the same step, since ranks step in lockstep) calls ``rebalance(placement, sync=True)``,
which sums the ranks' windows so all compute the same placement, and then applies it:

    res = manager.rebalance(executor.placement, sync=True, group=executor.group)
    # moves weights, agrees on the swap with a commit all_reduce, swaps
    placement_sync.commit_placement(executor, res.placement, executor.group, load_fn)

Imbalance is ``max-rank load / mean-rank load`` over live ranks, assuming an expert's
tokens split evenly over its replicas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from elasticep.eplb.placement import Placement
from elasticep.eplb.rebalance import rebalance_placement

logger = logging.getLogger(__name__)


def rank_loads(counts: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Tokens each rank serves, per layer.

    Args:
        counts: [L, E] tokens routed to each logical expert.
        placement: where the experts live.

    Returns:
        [L, max_ep_size] float64; inactive ranks are 0.
    """
    L, E = counts.shape
    if (L, E) != (placement.num_layers, placement.num_logical_experts):
        raise ValueError(f"counts {tuple(counts.shape)} do not match the placement")
    replicas = placement.replica_counts().double().clamp(min=1)
    per_replica = torch.cat([counts.double().cpu() / replicas, torch.zeros(L, 1)], dim=1)
    slot_load = per_replica.gather(1, placement.phy2log)  # EMPTY slots read the 0 column
    return slot_load.view(L, placement.max_ep_size, placement.slots_per_rank).sum(-1)


def compute_imbalance(counts: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Per-layer ``max-rank load / mean-rank load`` over live ranks.

    Args:
        counts: [L, E] tokens per (layer, logical expert).
        placement: where the experts live.

    Returns:
        [L] float64, 1.0 for a perfectly balanced (or empty) layer.
    """
    loads = rank_loads(counts, placement)[:, placement.active_ranks]
    mean = loads.mean(-1)
    return torch.where(mean > 0, loads.max(-1).values / mean.clamp(min=1e-12), torch.ones_like(mean))


@dataclass(frozen=True)
class EPLBConfig:
    """EPLB settings (``--enable-eplb``, ``--eplb-rebalance-num-iterations``).

    Attributes:
        enabled: rebalance periodically.
        rebalance_num_iterations: steps between rebalances.
        window_size: steps of counts kept (the sliding window).

    Raises:
        ValueError: (at construction) ``rebalance_num_iterations`` or ``window_size``
            below 1.
    """

    enabled: bool = False
    rebalance_num_iterations: int = 1000
    window_size: int = 128

    def __post_init__(self) -> None:
        if self.window_size <= 0 or self.rebalance_num_iterations <= 0:
            raise ValueError("window_size and rebalance_num_iterations must be positive, got "
                             f"{self.window_size} and {self.rebalance_num_iterations}")


@dataclass(frozen=True)
class RebalanceResult:
    """A new placement and the imbalance (mean over layers) it gives on the window's counts."""

    placement: Placement
    imbalance_before: float
    imbalance_after: float


class EPLBManager:
    """Sliding-window token counts per (layer, logical expert) and the rebalance trigger."""

    def __init__(
        self, num_layers: int, num_logical_experts: int, config: EPLBConfig, rank: int = 0, epoch: int = 0
    ) -> None:
        self.config = config
        self.num_layers = num_layers
        self.num_logical_experts = num_logical_experts
        self.rank = rank
        self.epoch = epoch
        # Ring of per-step counts plus their running sum, so reading the window is O(1).
        self._ring = torch.zeros(config.window_size, num_layers, num_logical_experts, dtype=torch.int64)
        self._sum = torch.zeros(num_layers, num_logical_experts, dtype=torch.int64)
        self._current = torch.zeros(num_layers, num_logical_experts, dtype=torch.int64)
        self._pos = 0
        self._steps_since_reset = 0

    def record(self, layer_idx: int, topk_ids: torch.Tensor) -> None:
        """Add one MoE layer's routing of this step.

        Args:
            layer_idx: MoE layer index in [0, L).
            topk_ids: [T, k] int64 logical expert ids.
        """
        flat = topk_ids.reshape(-1).cpu()
        self._current[layer_idx] += torch.bincount(flat, minlength=self.num_logical_experts)[
            : self.num_logical_experts
        ]

    def step(self) -> bool:
        """Close the step into the window; True when a rebalance is due now."""
        self._sum += self._current - self._ring[self._pos]
        self._ring[self._pos] = self._current
        self._pos = (self._pos + 1) % self.config.window_size
        self._current = torch.zeros_like(self._current)
        self._steps_since_reset += 1
        return self.config.enabled and self._steps_since_reset % self.config.rebalance_num_iterations == 0

    def window_counts(self) -> torch.Tensor:
        """[L, E] int64 tokens per (layer, logical expert) over the last ``window_size`` steps."""
        return self._sum.clone()

    def reset_generator(self, epoch: int | None = None) -> None:
        """Restart the rebalance countdown, e.g. after a membership change.

        The counts are kept: they are per logical expert, so they stay valid across
        placements; only the schedule restarts, as on every survivor at the same step.
        """
        self._steps_since_reset = 0
        self._current.zero_()
        if epoch is not None:
            self.epoch = epoch

    def rebalance(
        self,
        placement: Placement,
        active_ranks: torch.Tensor | None = None,
        sync: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> RebalanceResult:
        """Compute a balanced placement from the window's counts and log the imbalance.

        Args:
            placement: the current placement.
            active_ranks: [max_ep_size] bool, default ``placement.active_ranks``.
            sync: sum the counts over ``group`` first (collective: every live member
                calls this at the same step), so every rank sees the global load and
                derives the same placement. Without it, only this rank's counts.
            group: the EP group for ``sync`` (None: the default group).

        Returns:
            The new placement with the imbalance before and after (mean over layers).
        """
        counts = self.window_counts()
        if sync:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        new = rebalance_placement(counts, placement, active_ranks)
        before = float(compute_imbalance(counts, placement).mean())
        after = float(compute_imbalance(counts, new).mean())
        logger.info(
            "[epoch %d rank %d] eplb rebalance: imbalance (max/mean rank load) %.3f -> %.3f over %d tokens",
            self.epoch, self.rank, before, after, int(counts.sum()),
        )
        return RebalanceResult(new, before, after)
