"""What the lockstep loop reads of its WORLD group's membership: the epoch, the active
slots and this rank's votes for the admissions and removals the coordinator pushed.

A plain (not fault-tolerant) group has no membership: epoch 0, every slot active and
no vote, so the baseline loop runs the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import elasticep.distributed as ed
from elasticep.membership.transitions import SlotState


class GroupView:
    """The loop's reads of ``group``'s membership.

    Args:
        group: the WORLD group.
        fault_tolerant: it is the elastic backend's group (else a plain one).
        max_ep_size: M, the slots of the deployment.
    """

    def __init__(self, group: dist.ProcessGroup | None, fault_tolerant: bool,
                 max_ep_size: int) -> None:
        self.group, self.fault_tolerant, self.M = group, fault_tolerant, max_ep_size

    def epoch(self) -> int:
        """The group's current epoch (0 for a plain group)."""
        return ed.get_current_epoch(self.group) if self.fault_tolerant else 0

    def active_mask(self) -> torch.Tensor:
        """[M] bool, the active slots as this rank knows them now."""
        if not self.fault_tolerant:
            return torch.ones(self.M, dtype=torch.bool)
        return ed.get_active_ranks(self.group).to(torch.bool)

    def votes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[M] int64 admission and removal votes of this rank (from the coordinator's
        push): 1 for a slot that is ready to be admitted, or active and to be removed."""
        admit = torch.zeros(self.M, dtype=torch.int64)
        remove = torch.zeros(self.M, dtype=torch.int64)
        if self.fault_tolerant:
            req = ed.get_pending_requests(self.group)
            states = ed.get_slot_states(self.group)
            for r in req.get("admit", []):
                if states[r] == SlotState.READY:
                    admit[r] = 1
            active = self.active_mask()
            for r in req.get("remove", []):
                if bool(active[r]):
                    remove[r] = 1
        return admit, remove
