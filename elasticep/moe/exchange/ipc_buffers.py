"""The memory of the same-host exchange: one rank's buffers, and its peers' mapped ones.

Per rank (``G = max_ep_size``, ``C_max`` rows per source block for the largest step,
``W`` = :func:`~elasticep.moe.exchange.padded_exchange.row_width`): a dispatch buffer
``[G*C_max, W]`` and a combine buffer ``[G*C_max, H]`` in the model dtype, flags
``[G, n_slots]`` int32 and a counter ``[G]``, carved from one allocation (the arena)
that is exported as one CUDA IPC handle through the rendezvous store. The send kernels
find every rank's buffers through a device pointer table ``[G, 3]`` int64, so mapping a
peer anew rewrites a row of the table and a captured graph stays valid. The exchange
itself (:class:`~elasticep.moe.exchange.ipc_exchange.IpcExchange`) builds on this.
"""

from __future__ import annotations

import torch

from elasticep.moe.exchange.padded_exchange import ROW_ALIGN, row_width
from elasticep.utils import cuda_ipc

HANDLE_KEY = "elasticep/ipc_exchange/{rank}/{gen}"
GEN_KEY = "elasticep/ipc_exchange/{rank}/generation"
_ALIGN = 256


def capacity_rows(max_step_tokens: int, top_k: int) -> int:
    """``C_max``: rows per source block for the largest step (every pair of a step could go
    to one rank), rounded up to the padded layout's alignment."""
    rows = max(max_step_tokens * top_k, 1)
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def buffer_bytes(max_ep_size: int, cap_rows: int, hidden_size: int, dtype: torch.dtype,
                 num_layers: int) -> int:
    """Bytes one rank allocates for the exchange (the arena of :class:`IpcBuffers`);
    ``num_layers``: the layers that exchange (an upper bound is fine)."""
    elem = torch.empty((), dtype=dtype).element_size()
    parts = [max_ep_size * cap_rows * row_width(hidden_size, dtype) * elem,
             max_ep_size * cap_rows * hidden_size * elem,
             max_ep_size * 2 * num_layers * 4, max_ep_size * 4]
    return sum(-(-p // _ALIGN) * _ALIGN for p in parts)


class IpcBuffers:
    """One rank's exchange memory: its arena's views, the ``active`` mask, the pointer
    table, and the peers' mapped arenas.

    Args:
        rank, max_ep_size, cap_rows, hidden_size, dtype: as
            :class:`~elasticep.moe.exchange.ipc_exchange.IpcExchange` takes them (this
            rank's row block, G, ``C_max`` of :func:`capacity_rows`, H, the rows' dtype).
        n_slots: flag columns (two per exchanging layer).
        device: this rank's device (``"cpu"``: the one-process simulation, whose peers
            are other objects given to :meth:`map_local`).
    """

    def __init__(self, rank: int, max_ep_size: int, cap_rows: int, hidden_size: int,
                 dtype: torch.dtype, n_slots: int, device: torch.device | str) -> None:
        self.rank, self.G, self.cap_rows, self.H = rank, max_ep_size, cap_rows, hidden_size
        self.dtype, self.n_slots = dtype, n_slots
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.W = row_width(hidden_size, dtype)
        G, C = max_ep_size, cap_rows
        self.nbytes = buffer_bytes(G, C, hidden_size, dtype, n_slots // 2)
        self.arena = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.recv0, self.recv1, self.flags, self.counter = self._carve(self.arena)
        self.active = torch.zeros(G, dtype=torch.int32, device=self.device)
        self.active[rank] = 1
        # per rank: dispatch buffer, combine buffer, flags (device addresses)
        self.table = torch.zeros(G, 3, dtype=torch.int64, device=self.device)
        self.peers: dict[int, tuple[int, torch.Tensor]] = {}  # rank -> (generation, arena)
        self._peer_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._set_row(rank, self.arena)  # this rank's own row of views and pointers
        self._published: tuple[int, bytes] | None = None  # (generation, handle)

    def _carve(self, arena: torch.Tensor) -> tuple[torch.Tensor, ...]:
        G, C, H, W = self.G, self.cap_rows, self.H, self.W
        elem = torch.empty((), dtype=self.dtype).element_size()
        sizes = [G * C * W * elem, G * C * H * elem, G * self.n_slots * 4, G * 4]
        out, off = [], 0
        for n in sizes:
            out.append(arena[off:off + n])
            off += -(-n // _ALIGN) * _ALIGN
        recv0 = out[0].view(self.dtype).view(G * C, W)
        recv1 = out[1].view(self.dtype).view(G * C, H)
        flags = out[2].view(torch.int32).view(G, self.n_slots)
        counter = out[3].view(torch.int32)
        return recv0, recv1, flags, counter

    def _set_row(self, q: int, arena: torch.Tensor) -> None:
        recv0, recv1, flags, _ = self._carve(arena)
        self._peer_views[q] = (recv0, recv1, flags)
        self.table[q] = torch.tensor([recv0.data_ptr(), recv1.data_ptr(), flags.data_ptr()],
                                     dtype=torch.int64)

    def publish(self, store) -> int:
        """Put this rank's IPC handle in the rendezvous ``store`` (a torch.distributed
        Store) under a new generation of its slot; returns the generation. A relaunched
        rank publishes anew, so survivors map the new process's memory, not the old."""
        gen = store.add(GEN_KEY.format(rank=self.rank), 1)
        handle = cuda_ipc.share(self.arena)
        store.set(HANDLE_KEY.format(rank=self.rank, gen=gen), handle)
        self._published = (gen, handle)
        return gen

    def republish(self, store) -> None:
        """Put the last :meth:`publish` again, same generation and handle, in ``store``
        (a new coordinator leader's, which has none of it): the handle first, so that a
        peer that sees the generation finds it. Peers that mapped it keep their mapping."""
        if self._published is None:
            return
        gen, handle = self._published
        store.set(HANDLE_KEY.format(rank=self.rank, gen=gen), handle)
        store.set(GEN_KEY.format(rank=self.rank), str(gen))

    def map_peers(self, store, ranks: list[int]) -> list[int]:
        """Map the newest published buffers of ``ranks`` (others than this one) whose
        generation this rank has not mapped yet; returns the ranks mapped now.

        Raises:
            RuntimeError: a rank has published nothing (it is not started).
        """
        mapped = []
        for q in ranks:
            if q == self.rank:
                continue
            gen = store.add(GEN_KEY.format(rank=q), 0)
            if gen == 0:
                raise RuntimeError(f"rank {q} has published no exchange buffers")
            if q in self.peers and self.peers[q][0] == gen:
                continue
            arena = cuda_ipc.open_shared(store.get(HANDLE_KEY.format(rank=q, gen=gen)))
            self.peers[q] = (gen, arena)
            self._set_row(q, arena)
            mapped.append(q)
        return mapped

    def map_local(self, peers: dict[int, IpcBuffers]) -> None:
        """CPU simulation: use other in-process exchanges' buffers as the peers'."""
        for q, ex in peers.items():
            if q != self.rank:
                self.peers[q] = (0, ex.arena)
                self._set_row(q, ex.arena)

    def unmap(self, q: int) -> None:
        """Drop the mapping of a departed rank ``q`` (its table row points at this rank's
        own buffers, which an inactive row never writes)."""
        if q == self.rank:
            return
        self.peers.pop(q, None)
        self._peer_views.pop(q, None)
        self.table[q] = self.table[self.rank]

    def private_state(self, rows: int | None = None) -> tuple:
        """A self-only copy of the exchange's state for compiling kernels: (dispatch
        buffer, table, active, counter, flags, what holds the buffers). ``rows``: that
        many rows a source instead of ``cap_rows`` (a copy of the whole arena)."""
        active = torch.zeros_like(self.active)
        active[self.rank] = 1
        flags, counter = torch.zeros_like(self.flags), torch.zeros_like(self.counter)
        table = torch.zeros_like(self.table)
        if rows is None:
            scratch = torch.zeros_like(self.arena)
            recv0, recv1, _, _ = self._carve(scratch)
        else:
            recv0 = torch.zeros(self.G * rows, self.W, dtype=self.dtype, device=self.device)
            recv1 = torch.zeros(self.G * rows, self.H, dtype=self.dtype, device=self.device)
            scratch = (recv0, recv1)
        table[self.rank] = torch.tensor([recv0.data_ptr(), recv1.data_ptr(), flags.data_ptr()],
                                        dtype=torch.int64)
        return recv0, table, active, counter, flags, scratch
