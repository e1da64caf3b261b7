"""The inner group of an epoch with one active member: collectives without a transport.

When a single rank is active, every collective is an identity or a local copy, yet the
inner Gloo group still hands each op to its worker thread and back. A served rank at
``--ep-size 1 --max-ep-size 2`` runs two such ops a step (the step header and the commit
vote, :mod:`elasticep.elastic.step_loop`), and on the CPU every MoE layer's all_to_all
too; the thread hand-off was about 0.37 ms an op on a 2-core machine. `GroupState.run`
hands a one-member epoch's CPU ops this object in place of the Gloo group: the ops
(:mod:`elasticep.distributed.ops`) and the consistency protocol around them are
unchanged, only the data movement is done here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DoneWork(dist.Work):
    """A Work that is already complete; ``get_future`` yields ``result``."""

    def __init__(self, result=None) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class SoloGroup:
    """The calls `ops` makes on an inner group, done in place for a group of one.

    Each takes the Gloo ProcessGroup method's arguments and returns a completed Work.

    Raises:
        ValueError: an all_to_all whose one send and one receive differ in size, or a
            call with other than one tensor per list (what Gloo would refuse).
    """

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> DoneWork:
        """SUM, MAX, MIN (and AVG before its division by 1) of one tensor: itself."""
        _one(tensors)
        return DoneWork(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> DoneWork:
        """The root is the only member: the tensor stays as it is."""
        _one(tensors)
        return DoneWork(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]],
                  inputs: list[torch.Tensor]) -> DoneWork:
        """``output_lists[0][0]`` takes a copy of ``inputs[0]``."""
        _one(output_lists)
        _one(output_lists[0])
        _one(inputs)
        output_lists[0][0].copy_(inputs[0])
        return DoneWork(output_lists)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts=None) -> DoneWork:
        """The member sends its rows to itself: ``output`` takes a copy of ``input``."""
        if output.numel() != input.numel():
            raise ValueError(f"all_to_all of one member: {input.numel()} elements sent, "
                             f"{output.numel()} expected")
        output.copy_(input.view(output.shape))
        return DoneWork([output])


def _one(items: list) -> None:
    if len(items) != 1:
        raise ValueError(f"a group of one takes one tensor per list, got {len(items)}")


SOLO = SoloGroup()
