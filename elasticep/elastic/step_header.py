"""The step header every rank of the lockstep loop agrees on, and the token bound it sets.

:func:`step_header` is one rank's contribution to the header all_reduce (SUM, int64
``[1 + 3*M]``), :func:`parse_header` reads the sum (:class:`StepHeader`), and
:func:`agreed_max_tokens` sets the agreed largest batch on the executor around a forward
(see :mod:`elasticep.elastic.step_loop` for the loop around them).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from elasticep.moe.ep_executor import EPMoEExecutor


@dataclass(frozen=True)
class StepHeader:
    """The agreed (summed) step header.

    Attributes:
        work: ranks with unfinished work (0 = the whole group is idle).
        admit: slots some rank asked to admit.
        remove: slots some rank asked to remove.
        tokens: [M] scheduled tokens of each slot's rank (0 for idle or absent ranks).
    """

    work: int
    admit: list[int]
    remove: list[int]
    tokens: list[int]

    @property
    def max_tokens(self) -> int:
        """The most tokens any rank forwards this step (the exchange capacity bound)."""
        return max(self.tokens, default=0)


def step_header(local_work: int, admit: torch.Tensor, remove: torch.Tensor, rank: int,
                num_tokens: int) -> torch.Tensor:
    """This rank's contribution to the header all_reduce (SUM).

    Args:
        local_work: 1 when this rank has unfinished work or a pending batch, else 0.
        admit, remove: [M] int64 votes of this rank.
        rank: this rank's slot (< M).
        num_tokens: tokens of this rank's pending batch (0 without one).

    Returns:
        [1 + 3*M] int64: ``[local_work, admit, remove, tokens]`` with ``tokens`` zero
        except ``num_tokens`` at ``rank``.
    """
    M = admit.numel()
    if not 0 <= rank < M:
        raise ValueError(f"rank {rank} outside the {M} slots")
    tokens = [0] * M
    tokens[rank] = num_tokens
    # one tensor from one list: a step pays this on its host path, and five small torch
    # ops cost several times the list
    return torch.tensor([local_work, *admit.tolist(), *remove.tolist(), *tokens],
                        dtype=torch.int64)


def parse_header(header: torch.Tensor, M: int) -> StepHeader:
    """Read the summed header of :func:`step_header` (``[1 + 3*M]``)."""
    if header.numel() != 1 + 3 * M:
        raise ValueError(f"header of {header.numel()} entries, want {1 + 3 * M}")
    h = header.tolist()
    return StepHeader(work=h[0],
                      admit=[r for r in range(M) if h[1 + r] > 0],
                      remove=[r for r in range(M) if h[1 + M + r] > 0],
                      tokens=h[1 + 2 * M:])


@contextmanager
def agreed_max_tokens(ep: EPMoEExecutor, max_tokens: int) -> Iterator[None]:
    """Set the executor's per-step token bound (one that ``uses_step_bound``, i.e. the
    CUDA one) for the body, then restore it; other executors are untouched."""
    if not ep.uses_step_bound:
        yield
        return
    before = ep.step_max_tokens
    ep.step_max_tokens = max_tokens
    try:
        yield
    finally:
        ep.step_max_tokens = before
