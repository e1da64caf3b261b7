"""eplb layer: expert placement over physical slots, its repair, and load balancing.

- ``placement``: slots per rank, :class:`Placement` (phy2log with an EMPTY padding value).
- ``deepseek``: DeepSeek-EPLB compatible :func:`rebalance_experts`.
- ``elastic``: pure repair / scale-up / scale-down of a placement, and the expert loads
  (peer copies or checkpoint reloads) a change needs.
- ``rebalance``: the elasticity-aware, move-minimising load rebalance.
- ``metadata``: :class:`ExpertLocationMetadata` and its broadcast from a healthy rank.
- ``manager``: :class:`EPLBManager` (sliding-window counts, periodic rebalance).
"""

from elasticep.eplb.deepseek import rebalance_experts
from elasticep.eplb.elastic import (
    ExpertLoad,
    plan_expert_loads,
    reconcile_placement,
    repair_and_plan,
    repair_placement,
    scale_down_placement,
    scale_up_placement,
)
from elasticep.eplb.manager import (
    EPLBConfig,
    EPLBManager,
    RebalanceResult,
    compute_imbalance,
    rank_loads,
)
from elasticep.eplb.metadata import (
    ExpertLocationMetadata,
    broadcast_global_expert_location_metadata,
)
from elasticep.eplb.placement import Placement, initial_placement, initial_slots_per_rank
from elasticep.eplb.rebalance import rebalance_placement

__all__ = [
    "EPLBConfig",
    "EPLBManager",
    "ExpertLoad",
    "ExpertLocationMetadata",
    "Placement",
    "RebalanceResult",
    "broadcast_global_expert_location_metadata",
    "compute_imbalance",
    "initial_placement",
    "initial_slots_per_rank",
    "plan_expert_loads",
    "rank_loads",
    "rebalance_experts",
    "rebalance_placement",
    "reconcile_placement",
    "repair_and_plan",
    "repair_placement",
    "scale_down_placement",
    "scale_up_placement",
]
