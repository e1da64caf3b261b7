"""The collective ops' checks, made before any I/O so that a bad call never leaves the
ranks out of step, and reduce_scatter's choice of its slot's rows."""

import pytest
import torch
import torch.distributed as dist

from elasticep.distributed.ops import AllReduce, ReduceScatter


@pytest.mark.parametrize("dtype, op, words", [
    (torch.int16, dist.ReduceOp.SUM, "unsupported dtype torch.int16"),
    (torch.bool, dist.ReduceOp.AVG, "AVG is undefined for bool"),
])
def test_reduce_scatter_checks_like_all_reduce(dtype, op, words):
    with pytest.raises(ValueError, match=words):
        AllReduce(torch.zeros(4, dtype=dtype), op)
    with pytest.raises(ValueError, match=words):
        ReduceScatter(torch.zeros(2, dtype=dtype), torch.zeros(4, dtype=dtype), op, 0, 2)


def test_reduce_scatter_refuses_a_mismatched_input():
    with pytest.raises(ValueError, match="input dim0 5 != 2 x output dim0 2"):
        ReduceScatter(torch.zeros(2), torch.zeros(5), dist.ReduceOp.SUM, 0, 2)


def test_reduce_scatter_keeps_its_slots_rows():
    out, inp = torch.zeros(2, 3), torch.zeros(6, 3)
    op = ReduceScatter(out, inp, dist.ReduceOp.SUM, slot=1, size=3)
    assert op.kind == "reduce_scatter" and op.fetchable and op.redoable([0, 1, 2])
    reduced = torch.arange(18.0).reshape(6, 3)
    op.apply([reduced])
    assert torch.equal(out, reduced[2:4])
    assert torch.equal(inp, torch.zeros(6, 3))  # the caller's input is never written
