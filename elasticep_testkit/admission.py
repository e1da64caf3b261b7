"""The header agreement of a lockstep loop on the elastic backend, for the tests' and
the benches' worker processes: which ready slots all members admit at this step."""

from __future__ import annotations

import torch
import torch.distributed as dist

import elasticep.distributed as ed


def agree_ready(watch, size: int) -> list[int]:
    """The slots of ``watch`` that some member sees ``ready``, agreed by every member.

    A collective on WORLD (a MAX all_reduce of a ready flag per slot), so every member
    must call it at the same step; they then pass the same list to ``recover_ranks``.

    Args:
        watch: the slots that may be admitted; size: WORLD's slot count.
    Returns:
        The agreed slots, in ``watch``'s order (empty: none to admit this step).
    """
    states = ed.get_slot_states()
    ready = torch.tensor([1.0 if states[s] == "ready" else 0.0 for s in range(size)])
    dist.all_reduce(ready, op=dist.ReduceOp.MAX)  # agree on exactly which slots to admit
    return [s for s in watch if ready[s] > 0]
