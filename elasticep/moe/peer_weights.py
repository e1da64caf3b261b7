"""Expert weights of the other ranks of one host, mapped with CUDA IPC, so that a
placement change copies a peer's expert device to device instead of over the CPU group.

Every rank publishes the handles of its current per-layer expert tensors (``w13``,
``w2``) in the rendezvous store after each placement change, under a new generation of
its slot (:meth:`PeerWeights.publish`). Every rank maps its peers' newest generations
at the first step after a change (:meth:`PeerWeights.refresh`); during a change a
receiver checks that a source's mapping is of its newest generation
(:meth:`PeerWeights.experts`) and copies the slots it needs from the source's old
tensors. A tensor kept across a change keeps its share; the share of one that left is
given back at the next publish (:func:`elasticep.utils.cuda_ipc.release`), or torch
would hold its memory for good.

A rank that dies stays mapped until the repair is done: its memory outlives its process
while mapped, so the repair copies its orphans from its last tensors
(:meth:`PeerWeights.departed`, only if the mapping is of the last generation it
published) instead of reading the checkpoint, and the next refresh drops the mapping.

Why this is safe without messages: a change's first op is a collective, and a rank
publishes before it leaves the previous change, so the handles a receiver reads are
those of the source's current tensors; a source keeps its old tensors until the
change's commit, which every receiver enters only after its copies finished
(:func:`elasticep.moe.weight_transfer.move_expert_weights` waits for them). A source
that died before the receiver mapped it cannot be opened: the receiver skips its slots,
and the commit, a collective that needs the dead source, cannot succeed, so the change
is redone on the new membership.
"""

from __future__ import annotations

import logging
import pickle
import weakref

import torch

from elasticep.moe.weight_transfer import PeerUnavailable
from elasticep.utils import cuda_ipc

logger = logging.getLogger(__name__)

HANDLES_KEY = "elasticep/peer_weights/{rank}/{gen}"
GEN_KEY = "elasticep/peer_weights/{rank}/generation"

Layers = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]


class PeerWeights:
    """This rank's view of its host peers' expert weights.

    Implements the ``peers`` argument of
    :func:`elasticep.moe.weight_transfer.move_expert_weights`. Mappings persist between
    changes (:meth:`refresh` brings them to the newest generations), so that a rank that
    dies without a handover can still be read: its memory stays allocated while a
    survivor maps it, and the repair copies its orphans from there instead of reading
    the checkpoint; the next :meth:`refresh` drops the mapping, which frees that memory.

    Args:
        rank: this rank (its slot in the store keys).
        store: the deployment's rendezvous store (a ``torch.distributed.Store``), or None
            for the one-process simulation of tests (:meth:`map_local`).
    """

    def __init__(self, rank: int, store=None) -> None:
        self.rank, self.store = rank, store
        self._mapped: dict[int, tuple[int, Layers]] = {}  # rank -> (generation, tensors)
        self._checked: set[int] = set()  # live sources checked for staleness this change
        self._local: dict[int, Layers] = {}
        # this rank's published tensors and their shares: a tensor kept across a change
        # keeps its share; the share of one that left is given back (cuda_ipc.release)
        self._shares: list[tuple[weakref.ref, bytes]] = []
        self.departed_copies = 0  # orphans copied from a departed rank's memory
        self._published: tuple[int, bytes] | None = None  # (generation, pickled handles)

    def publish(self, w13: list[torch.Tensor | None], w2: list[torch.Tensor | None]) -> int:
        """Publish the handles of this rank's current per-layer tensors (None: a dense
        layer) under a new generation; returns it. Call after every placement change,
        before the next collective."""
        if self.store is None:
            return 0
        old, kept = self._shares, []

        def handle(t: torch.Tensor | None) -> bytes | None:
            if t is None:
                return None
            h = next((h for ref, h in old if ref() is t), None) or cuda_ipc.share(t)
            kept.append((weakref.ref(t), h))
            return h

        handles = ([handle(t) for t in w13], [handle(t) for t in w2])
        current = {h for _ref, h in kept}
        # every consumer of the last generation copied before the change's commit,
        # which is behind this call: give back the shares of the tensors that left
        # (a consumer still mapping one reads it no more: its generation is stale)
        for _ref, h in old:
            if h not in current:
                cuda_ipc.release(h)
        self._shares = kept
        torch.cuda.ipc_collect()  # frees those of them this rank already dropped
        gen = self.store.add(GEN_KEY.format(rank=self.rank), 1)
        blob = pickle.dumps(handles)
        self.store.set(HANDLES_KEY.format(rank=self.rank, gen=gen), blob)
        self._published = (gen, blob)
        return gen

    def republish(self, store) -> None:
        """Put the last :meth:`publish` again, same generation and handles, in ``store``
        (a new coordinator leader's, which has none of it), handles first. The shares
        are the same, so a peer's mapping of that generation stays valid."""
        if self._published is None:
            return
        gen, blob = self._published
        store.set(HANDLES_KEY.format(rank=self.rank, gen=gen), blob)
        store.set(GEN_KEY.format(rank=self.rank), str(gen))

    def map_local(self, peers: dict[int, Layers]) -> None:
        """One-process simulation (tests): rank ``q``'s tensors are ``peers[q]``, live or
        departed alike."""
        self._local = dict(peers)

    def refresh(self, ranks: list[int]) -> list[int]:
        """Map the newest generation of each of ``ranks`` (the members) where it is not
        mapped yet, and drop every other rank's mapping (a departed rank's memory is
        freed then). Call at a boundary every member passed after its last publish (the
        step header after a change). Returns the ranks mapped now.

        A member that published nothing yet, or cannot be mapped, is skipped (logged):
        a change maps it on first use (:meth:`experts`)."""
        for q in [q for q in self._mapped if q not in ranks]:
            del self._mapped[q]
        fresh = []
        for q in ranks:
            if q == self.rank or self.store is None:
                continue
            try:
                if self._ensure(q):
                    fresh.append(q)
            except PeerUnavailable as exc:
                logger.warning("expert weights of rank %d not mapped: %s", q, exc)
        return fresh

    def experts(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Live rank ``rank``'s ``w13`` [S, 2*I, H] and ``w2`` [S, H, I] of MoE layer
        ``layer``, as mapped views of its memory (its newest published generation,
        checked once per change).

        Raises:
            PeerUnavailable: the rank published nothing, or its memory cannot be mapped.
        """
        if rank in self._local:
            return self._layer(rank, self._local[rank], layer)
        if rank not in self._checked:
            self._ensure(rank)
            self._checked.add(rank)
        return self._layer(rank, self._mapped[rank][1], layer)

    def departed(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Departed rank ``rank``'s tensors of ``layer``, where the mapping is of the last
        generation it published (a stale one may point at memory it reused).

        Raises:
            PeerUnavailable: not mapped, or mapped at an older generation.
        """
        if rank in self._local:
            return self._layer(rank, self._local[rank], layer)
        entry = self._mapped.get(rank)
        if entry is None or self.store is None:
            raise PeerUnavailable(f"rank {rank} is not mapped")
        last = self.store.add(GEN_KEY.format(rank=rank), 0)
        if entry[0] != last:
            raise PeerUnavailable(f"rank {rank} is mapped at generation {entry[0]}, "
                                  f"not its last ({last})")
        return self._layer(rank, entry[1], layer)

    @property
    def mapped_ranks(self) -> list[int]:
        """The ranks whose tensors this rank maps now (sorted)."""
        return sorted(self._mapped)

    def end_change(self) -> None:
        """After a change (committed or not): the next one checks generations again."""
        self._checked.clear()

    @staticmethod
    def _layer(rank: int, tensors: Layers, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = tensors[0][layer], tensors[1][layer]
        if a is None or b is None:
            raise PeerUnavailable(f"rank {rank} has no experts in layer {layer}")
        return a, b

    def _ensure(self, rank: int) -> bool:
        """Map ``rank``'s newest generation unless it is mapped; True if mapped now."""
        if self.store is None:
            raise PeerUnavailable(f"rank {rank} is not mapped (no store)")
        gen = self.store.add(GEN_KEY.format(rank=rank), 0)
        if gen == 0:
            raise PeerUnavailable(f"rank {rank} has published no expert weights")
        if rank in self._mapped and self._mapped[rank][0] == gen:
            return False
        h13, h2 = pickle.loads(self.store.get(HANDLES_KEY.format(rank=rank, gen=gen)))
        try:
            tensors = ([None if h is None else cuda_ipc.open_shared(h) for h in h13],
                       [None if h is None else cuda_ipc.open_shared(h) for h in h2])
        except RuntimeError as exc:
            raise PeerUnavailable(f"rank {rank}'s expert weights (generation {gen}) cannot "
                                  f"be mapped: {exc}") from exc
        self._mapped[rank] = (gen, tensors)
        return True
