"""Expert weights of the other ranks of one host, mapped with CUDA IPC, so that a
placement change copies a peer's expert device to device instead of over the CPU group.

Every rank publishes the handles of its current per-layer expert tensors (``w13``,
``w2``) in the rendezvous store after each placement change, under a new generation of
its slot (:meth:`PeerWeights.publish`). During the next change a receiver maps a
source's newest generation on first use (:meth:`PeerWeights.experts`), copies the
slots it needs from the source's old tensors, and drops every mapping once the change
is committed (:meth:`PeerWeights.close`). A tensor kept across a change keeps its
share; the share of one that left is given back at the next publish
(:func:`elasticep.utils.cuda_ipc.release`), or torch would hold its memory for good.

Why this is safe without messages: a change's first op is a collective, and a rank
publishes before it leaves the previous change, so the handles a receiver reads are
those of the source's current tensors; a source keeps its old tensors until the
change's commit, which every receiver enters only after its copies finished
(:func:`elasticep.eplb.weight_transfer.move_expert_weights` waits for them). A source
that died before the receiver mapped it cannot be opened: the receiver skips its slots,
and the commit, a collective that needs the dead source, cannot succeed, so the change
is redone on the new membership.
"""

from __future__ import annotations

import logging
import pickle
import weakref

import torch

from elasticep.eplb.weight_transfer import PeerUnavailable
from elasticep.utils import cuda_ipc

logger = logging.getLogger(__name__)

HANDLES_KEY = "elasticep/peer_weights/{rank}/{gen}"
GEN_KEY = "elasticep/peer_weights/{rank}/generation"

Layers = tuple[list[torch.Tensor | None], list[torch.Tensor | None]]


class PeerWeights:
    """This rank's view of its host peers' expert weights.

    Implements the ``peers`` argument of
    :func:`elasticep.eplb.weight_transfer.move_expert_weights`.

    Args:
        rank: this rank (its slot in the store keys).
        store: the deployment's rendezvous store (a ``torch.distributed.Store``), or None
            for the one-process simulation of tests (:meth:`map_local`).
    """

    def __init__(self, rank: int, store=None) -> None:
        self.rank, self.store = rank, store
        self._mapped: dict[int, Layers] = {}
        self._local: dict[int, Layers] = {}
        # this rank's published tensors and their shares: a tensor kept across a change
        # keeps its share; the share of one that left is given back (cuda_ipc.release)
        self._shares: list[tuple[weakref.ref, bytes]] = []
        self.published = 0  # generations this rank published

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
        for _ref, h in old:
            if h not in current:
                cuda_ipc.release(h)
        self._shares = kept
        torch.cuda.ipc_collect()  # frees those of them this rank already dropped
        gen = self.store.add(GEN_KEY.format(rank=self.rank), 1)
        self.store.set(HANDLES_KEY.format(rank=self.rank, gen=gen), pickle.dumps(handles))
        self.published = gen
        return gen

    def map_local(self, peers: dict[int, Layers]) -> None:
        """One-process simulation (tests): rank ``q``'s tensors are ``peers[q]``."""
        self._local = dict(peers)

    def experts(self, rank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s ``w13`` [S, 2*I, H] and ``w2`` [S, H, I] of MoE layer ``layer``,
        as mapped views of its memory (its newest published generation, mapped on first
        use in this change).

        Raises:
            PeerUnavailable: the rank published nothing, or its memory cannot be mapped.
        """
        if rank in self._local:
            w13, w2 = self._local[rank]
        else:
            if rank not in self._mapped:
                self._mapped[rank] = self._open(rank)
            w13, w2 = self._mapped[rank]
        a, b = w13[layer], w2[layer]
        if a is None or b is None:
            raise PeerUnavailable(f"rank {rank} has no experts in layer {layer}")
        return a, b

    def _open(self, rank: int) -> Layers:
        if self.store is None:
            raise PeerUnavailable(f"rank {rank} is not mapped (no store)")
        gen = self.store.add(GEN_KEY.format(rank=rank), 0)
        if gen == 0:
            raise PeerUnavailable(f"rank {rank} has published no expert weights")
        h13, h2 = pickle.loads(self.store.get(HANDLES_KEY.format(rank=rank, gen=gen)))
        try:
            return ([None if h is None else cuda_ipc.open_shared(h) for h in h13],
                    [None if h is None else cuda_ipc.open_shared(h) for h in h2])
        except RuntimeError as exc:
            raise PeerUnavailable(f"rank {rank}'s expert weights (generation {gen}) cannot "
                                  f"be mapped: {exc}") from exc

    def close(self) -> None:
        """Drop every mapping (the sources' old tensors can then be freed)."""
        self._mapped.clear()
