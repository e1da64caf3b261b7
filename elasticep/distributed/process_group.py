"""`ElasticProcessGroup`: the Python ProcessGroup torch.distributed dispatches to.

Every method turns its arguments into an `ops` object and hands it to the group's
`GroupState.run`, which runs it on the current epoch's inner group (Gloo for CPU
tensors, NCCL for CUDA ones) and keeps it consistent across epoch changes. Ops are
synchronous: the returned Work is already complete, except a steady-state CUDA
all_to_all_single in an on_failure="raise" group, which returns the NCCL Work
(`GroupState.fast_all_to_all`), and send/recv, which are asynchronous: their Work
completes in `wait` (`p2p.P2PWork`). Both torch 2.11 names (alltoall_base, _allgather_base,
_reduce_scatter_base) and 2.13 names (all_to_all_single, all_gather_single,
reduce_scatter_single) exist.

Ranks are group slots: `size()` is the group's capacity (max_group_size) and
`get_active_ranks` marks the holes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops
from .solo import DoneWork
from .state import GroupState


def _reduce_op(opts):
    return getattr(opts, "reduceOp", opts) if opts is not None else dist.ReduceOp.SUM


class ElasticProcessGroup(dist.ProcessGroup):
    """A fault-tolerant group of `size` slots; see the package docstring for semantics."""

    def __init__(self, gs: GroupState, slot: int, size: int) -> None:
        super().__init__(slot, size)
        self.gs, self._slot, self._size = gs, slot, size

    # identity ---------------------------------------------------------------
    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._slot

    def getBackendName(self) -> str:
        return "elastic"

    def name(self) -> str:
        return "elastic"

    # collectives ------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        for t in tensors:
            self.gs.run(ops.AllReduce(t, _reduce_op(opts)))
        return DoneWork(tensors)

    def broadcast(self, tensors, opts=None):
        for t in tensors:
            self.gs.run(ops.Broadcast(t, _root(opts), self._slot))
        return DoneWork(tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            self.gs.run(ops.AllGather(outs, inp))
        return DoneWork(output_tensors)

    def all_gather_single(self, output, input, opts=None):
        self.gs.run(ops.AllGatherInto(output, input, self._size))
        return DoneWork(output)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        self.gs.run(ops.ReduceScatter(output, input, _reduce_op(opts), self._slot, self._size))
        return DoneWork(output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            self.reduce_scatter_single(out, torch.cat(ins), opts)
        return DoneWork(output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                          opts=None):
        work = self.gs.fast_all_to_all(output, input, output_split_sizes, input_split_sizes)
        if work is not None:  # steady state on CUDA: the NCCL work itself
            return work
        self.gs.run(ops.AllToAll(output, input, list(output_split_sizes),
                                 list(input_split_sizes), self._size))
        return DoneWork(output)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        self.gs.run(ops.Barrier())
        return DoneWork()

    def reduce(self, tensors, opts=None):
        for t in tensors:
            self.gs.run(ops.Reduce(t, _reduce_op(opts), _root(opts), self._slot))
        return DoneWork(tensors)

    def gather(self, output_tensors, input_tensors, opts=None):
        # torch passes no output list at all on non-roots
        outputs = output_tensors or [[] for _ in input_tensors]
        for outs, inp in zip(outputs, input_tensors, strict=True):
            self.gs.run(ops.Gather(outs, inp, _root(opts), self._slot, self._size))
        return DoneWork(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = _root(opts)
        ins = input_tensors if self._slot == root else [[]] * len(output_tensors)
        for out, inp in zip(output_tensors, ins, strict=True):
            self.gs.run(ops.Scatter(out, inp, root, self._slot, self._size))
        return DoneWork(output_tensors)

    # point to point (no sequence number, asynchronous; see `p2p`) -------------
    def send(self, tensors, dst: int, tag: int = 0):
        (t,) = tensors
        return self.gs.peers.post("send", t, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        (t,) = tensors
        return self.gs.peers.post("recv", t, src, tag)

    # lifetime ---------------------------------------------------------------
    def shutdown(self) -> None:
        """torch.distributed.destroy_process_group: this rank leaves the group."""
        self.gs.close()

    abort = shutdown


def _root(opts) -> int:
    return getattr(opts, "rootRank", 0) if opts is not None else 0
