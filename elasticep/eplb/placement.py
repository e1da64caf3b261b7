"""Physical expert slots and the placement of logical experts on them.

Layout (DESIGN.md, "Slots"): every rank owns ``slots_per_rank`` consecutive physical
slots, so slot ``p`` lives on rank ``p // slots_per_rank`` and the slot capacity is
``P = slots_per_rank * max_ep_size``. Slots of inactive ranks are inactive.

A :class:`Placement` is plain data: which logical expert each physical slot holds, per
MoE layer. An empty slot (on an inactive rank, or a spare slot on a live rank) holds the
documented padding value ``EMPTY = num_logical_experts``: out of range on purpose, so an
accidental index with it fails loudly instead of silently reading expert 0.

When the live slots cannot hold every expert (R = 0 and a rank dies), the repair grows
``slots_per_rank`` for every rank (see :mod:`elasticep.eplb.elastic`); a placement is
therefore re-laid out with ``Placement.with_slots_per_rank``, which keeps each expert on
its (rank, local slot) and appends empty local slots. Weights are addressed by
(rank, local slot), so growth moves no weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def initial_slots_per_rank(num_logical_experts: int, num_redundant: int, initial_ep_size: int,
                           min_ep_size: int | None = None) -> int:
    """The slots each rank has at launch: ``ceil((E + R) / initial_ep_size)`` hold experts,
    and with ``min_ep_size`` the count is raised to ``ceil(E / min_ep_size)``, so that
    ``min_ep_size`` ranks can hold every expert without growing (the extra slots start
    EMPTY: reserved memory, see :func:`initial_placement`).

    Raises:
        ValueError: on a non-positive size, a negative redundancy, or ``min_ep_size``
            outside ``[1, initial_ep_size]``.
    """
    if num_logical_experts <= 0 or initial_ep_size <= 0 or num_redundant < 0:
        raise ValueError(
            f"bad sizes: E={num_logical_experts} R={num_redundant} ep={initial_ep_size}"
        )
    launch = math.ceil((num_logical_experts + num_redundant) / initial_ep_size)
    if min_ep_size is None:
        return launch
    if not 1 <= min_ep_size <= initial_ep_size:
        raise ValueError(f"min_ep_size {min_ep_size} outside [1, {initial_ep_size}]")
    return max(launch, math.ceil(num_logical_experts / min_ep_size))


@dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert every physical slot holds, for all MoE layers.

    Attributes:
        phy2log: [num_layers, P] int64 CPU, ``P = slots_per_rank * max_ep_size``; the
            logical expert of each slot, or ``num_logical_experts`` (EMPTY) for a slot
            that holds nothing.
        num_logical_experts: E.
        slots_per_rank: physical slots per rank (may exceed the launch value after a
            repair that had to grow).
        active_ranks: [max_ep_size] bool CPU; slots of inactive ranks are always EMPTY.
    """

    phy2log: torch.Tensor
    num_logical_experts: int
    slots_per_rank: int
    active_ranks: torch.Tensor

    def __post_init__(self) -> None:
        if self.phy2log.dim() != 2 or self.phy2log.dtype != torch.int64:
            raise ValueError(f"phy2log must be int64 [L, P], got {self.phy2log.dtype} {tuple(self.phy2log.shape)}")
        if self.active_ranks.dim() != 1 or self.active_ranks.dtype != torch.bool:
            raise ValueError("active_ranks must be a bool [max_ep_size] tensor")
        if self.phy2log.shape[1] != self.slots_per_rank * self.active_ranks.numel():
            raise ValueError(
                f"P={self.phy2log.shape[1]} != slots_per_rank {self.slots_per_rank} * "
                f"max_ep_size {self.active_ranks.numel()}"
            )
        if self.phy2log.numel() and (self.phy2log.min() < 0 or self.phy2log.max() > self.empty):
            raise ValueError(f"phy2log values must lie in [0, {self.empty}]")
        dead = ~self.slot_rank_active()
        if bool((self.phy2log[:, dead] != self.empty).any()):
            raise ValueError("a slot of an inactive rank holds an expert")

    def __eq__(self, other: object) -> bool:
        """Value equality (the tensors compared elementwise)."""
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_logical_experts == other.num_logical_experts
            and self.slots_per_rank == other.slots_per_rank
            and torch.equal(self.active_ranks, other.active_ranks)
            and torch.equal(self.phy2log, other.phy2log)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside: not hashable

    # ---------------------------------------------------------------- shape
    @property
    def empty(self) -> int:
        """The padding value of an empty slot: ``num_logical_experts``."""
        return self.num_logical_experts

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def num_slots(self) -> int:
        """P, the physical slot capacity."""
        return int(self.phy2log.shape[1])

    @property
    def max_ep_size(self) -> int:
        return int(self.active_ranks.numel())

    def live_ranks(self) -> list[int]:
        """Active rank ids, ascending."""
        return [int(r) for r in torch.nonzero(self.active_ranks).flatten()]

    def slot_rank(self) -> torch.Tensor:
        """[P] int64: the rank that owns each slot."""
        return torch.arange(self.num_slots) // self.slots_per_rank

    def slot_rank_active(self) -> torch.Tensor:
        """[P] bool: whether each slot's rank is active."""
        return self.active_ranks[self.slot_rank()]

    def valid(self) -> torch.Tensor:
        """[L, P] bool: the slot holds an expert."""
        return self.phy2log != self.empty

    def local(self, rank: int) -> torch.Tensor:
        """[L, slots_per_rank] int64: the experts in ``rank``'s slots (EMPTY padded)."""
        s = self.slots_per_rank
        return self.phy2log[:, rank * s : (rank + 1) * s]

    def experts_held(self, rank: int) -> int:
        """Slots of ``rank`` that hold an expert, the most over MoE layers."""
        local = self.local(rank)
        if local.numel() == 0:
            return 0
        return int((local != self.empty).sum(dim=1).max())

    def replica_counts(self) -> torch.Tensor:
        """[L, E] int64: the number of slots holding each logical expert."""
        L, E = self.num_layers, self.num_logical_experts
        out = torch.zeros(L, E + 1, dtype=torch.int64)
        out.scatter_add_(1, self.phy2log, torch.ones_like(self.phy2log))
        return out[:, :E]

    # ---------------------------------------------------------------- derive
    def replica_width(self) -> int:
        """The replica count a slot layout of this shape holds when every rank hosts an
        expert at most ``ceil(slots_per_rank / E)`` times: ``max_ep_size`` times that.
        It depends on the shape alone, so the lookup tensors padded to it keep their
        shape across membership changes (see :meth:`log2phy`)."""
        return self.max_ep_size * math.ceil(self.slots_per_rank / self.num_logical_experts)

    def log2phy(self, width: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Invert phy2log.

        Args:
            width: the least X (the padded replica dimension), e.g.
                :meth:`replica_width`.

        Returns:
            log2phy: [L, E, X] int64, the slots of each expert ascending, padded with -1
                (X = the larger of ``width`` and the largest replica count, at least 1).
            logcnt: [L, E] int64, the number of valid entries of each row.
        """
        logcnt = self.replica_counts()
        L, E = logcnt.shape
        X = max(1, width, int(logcnt.max()) if logcnt.numel() else 1)
        out = torch.full((L, E, X), -1, dtype=torch.int64)
        for layer in range(L):
            row = self.phy2log[layer]
            slots = torch.nonzero(row != self.empty).flatten()
            # Stable sort by expert keeps each expert's slots ascending.
            order = torch.argsort(row[slots], stable=True)
            slots, experts = slots[order], row[slots][order]
            starts = torch.cumsum(logcnt[layer], 0) - logcnt[layer]
            rank_in_expert = torch.arange(slots.numel()) - starts[experts]
            out[layer, experts, rank_in_expert] = slots
        return out, logcnt

    def with_slots_per_rank(self, slots_per_rank: int) -> Placement:
        """The same assignment laid out with more slots per rank.

        Each expert keeps its (rank, local slot); the new local slots are EMPTY.

        Raises:
            ValueError: if ``slots_per_rank`` is smaller than the current value.
        """
        if slots_per_rank < self.slots_per_rank:
            raise ValueError("slots_per_rank can only grow")
        if slots_per_rank == self.slots_per_rank:
            return self
        L, M, s = self.num_layers, self.max_ep_size, self.slots_per_rank
        out = torch.full((L, M, slots_per_rank), self.empty, dtype=torch.int64)
        out[:, :, :s] = self.phy2log.view(L, M, s)
        return Placement(out.view(L, -1), self.num_logical_experts, slots_per_rank, self.active_ranks.clone())


def initial_placement(
    num_layers: int,
    num_logical_experts: int,
    num_redundant: int,
    initial_ep_size: int,
    max_ep_size: int | None = None,
    active_ranks: torch.Tensor | None = None,
    min_ep_size: int | None = None,
) -> Placement:
    """The launch placement: the k-th launch slot holds expert ``k % E``.

    A rank's launch slots are its first ``ceil((E + R) / initial_ep_size)``; with the
    first ``initial_ep_size`` ranks active and no ``min_ep_size`` this is ``phy2log[p] =
    p % E`` over the live slots. Consecutive slots of a rank then hold distinct experts
    whenever they are at most E, so replicas of one expert sit on different ranks.

    ``min_ep_size`` reserves slots: every rank gets ``ceil(E / min_ep_size)`` slots when
    that is more, the extra ones EMPTY. A membership change that keeps at least
    ``min_ep_size`` ranks then re-homes orphans into reserved slots instead of growing
    ``slots_per_rank``, so the executor's tensors keep their shapes and captured CUDA
    graphs stay valid; the memory a survivor needs is taken at launch, before the KV
    cache is sized from what is left.

    Args:
        num_layers: L, MoE layers.
        num_logical_experts: E.
        num_redundant: R, redundant slots (``--ep-num-redundant-experts``).
        initial_ep_size: ranks at launch; sets ``slots_per_rank``.
        max_ep_size: rank capacity (``--max-ep-size``), default ``initial_ep_size``.
        active_ranks: [max_ep_size] bool, default the first ``initial_ep_size`` ranks.
        min_ep_size: the fewest ranks that must hold every expert in these slots
            (``--min-ep-size``); None: no reserve.

    Returns:
        The placement; ``phy2log`` is [L, slots_per_rank * max_ep_size].

    Raises:
        ValueError: on bad sizes, or when the live slots cannot hold every expert.
    """
    launch = initial_slots_per_rank(num_logical_experts, num_redundant, initial_ep_size)
    spr = initial_slots_per_rank(num_logical_experts, num_redundant, initial_ep_size,
                                 min_ep_size)
    M = initial_ep_size if max_ep_size is None else max_ep_size
    if M < initial_ep_size or num_layers < 0:
        raise ValueError(f"max_ep_size {M} < initial_ep_size {initial_ep_size}")
    if active_ranks is None:
        active_ranks = torch.zeros(M, dtype=torch.bool)
        active_ranks[:initial_ep_size] = True
    active_ranks = active_ranks.to(torch.bool).cpu()
    if active_ranks.numel() != M:
        raise ValueError(f"active_ranks has {active_ranks.numel()} entries, want {M}")
    slot = torch.arange(spr * M)
    live = torch.nonzero(active_ranks[slot // spr] & (slot % spr < launch)).flatten()
    if live.numel() < num_logical_experts:
        raise ValueError(f"{live.numel()} live slots cannot hold {num_logical_experts} experts")
    row = torch.full((spr * M,), num_logical_experts, dtype=torch.int64)
    row[live] = torch.arange(live.numel()) % num_logical_experts
    return Placement(row.repeat(num_layers, 1), num_logical_experts, spr, active_ranks.clone())
