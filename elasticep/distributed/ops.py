"""Collective ops as small objects the consistency loop (`GroupState.run`) can execute.

Each op works on private buffers: an abandoned inner op may still write into its
buffers after the caller moved on, so user tensors are only written in `apply`, after
the op has completed consistently. In-place inputs are therefore copied first.

Dtype emulation (Gloo lacks AVG, and bool/fp16/bf16 reductions are not reliable):
fp16/bf16 reduce in fp32 and round once; bool reduces as int32 (SUM/MAX = any,
MIN/PRODUCT = all); AVG = SUM / number of active ranks (integer dtypes: floor
division). Byte-moving ops view fp16/bf16/bool as uint8 rows (dim0 kept).

Op attributes: `kind` (name), `fetchable` (the result is identical on every rank, so a
survivor that missed the op can take a donor's kept result), `redoable(active)` (it can
be re-run over the survivors in on_failure="complete" mode).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

_REDUCE = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
_BYTE_VIEW = (torch.bfloat16, torch.float16, torch.bool)


_VALID = {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.bool, torch.int8, torch.uint8}


def reduce_name(op) -> str:
    """Name of a ReduceOp / RedOpType. Raises ValueError for unsupported ops."""
    name = getattr(getattr(op, "op", op), "name", None)  # fast path: RedOpType.name
    if name in _REDUCE:
        return name
    for name in _REDUCE:
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"unsupported reduce op {op}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """View a contiguous tensor Gloo may not move natively as uint8 rows (dim0 kept)."""
    if t.dtype not in _BYTE_VIEW:
        return t
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(rows, math.prod(t.shape[1:])).view(torch.uint8)


def _prep_reduce(t: torch.Tensor, name: str):
    """Return (buffer, gloo ReduceOp, dtype to cast back to)."""
    if t.dtype == torch.bool:
        if name == "AVG":
            raise ValueError("AVG is undefined for bool tensors")
        op = dist.ReduceOp.MAX if name in ("SUM", "MAX") else dist.ReduceOp.MIN
        return t.to(torch.int32), op, torch.bool
    gop = dist.ReduceOp.SUM if name == "AVG" else getattr(dist.ReduceOp, name)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.to(torch.float32), gop, t.dtype
    return t.detach().clone(), gop, t.dtype


def _finish_reduce(buf: torch.Tensor, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    if name == "AVG":
        buf = buf / n if buf.is_floating_point() else torch.div(buf, n, rounding_mode="floor")
    return buf.to(dtype) if dtype != buf.dtype or dtype == torch.bool else buf


_OPTS: dict = {}  # AllreduceOptions per Gloo op (c10d copies them into each work)


def reduce_work(pg, t: torch.Tensor, name: str, n: int):
    """Start an all_reduce of a copy of t on inner group pg; returns (work, finalize)."""
    buf, gop, dtype = _prep_reduce(t, name)
    opts = _OPTS.get(gop.op if hasattr(gop, "op") else gop)
    if opts is None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = gop
        _OPTS[gop.op if hasattr(gop, "op") else gop] = opts
    work = pg.allreduce([buf], opts)
    return work, lambda: _finish_reduce(buf, name, n, dtype)


class AllReduce:
    kind, fetchable = "all_reduce", True

    def __init__(self, tensor: torch.Tensor, op) -> None:
        self.tensor, self.name = tensor, reduce_name(op)
        # validate before any I/O, so a bad call never desynchronises the ranks
        if tensor.dtype not in _VALID:
            raise ValueError(f"unsupported dtype {tensor.dtype}")
        if tensor.dtype == torch.bool and self.name == "AVG":
            raise ValueError("AVG is undefined for bool tensors")

    def redoable(self, active) -> bool:
        return True

    def start(self, pg, active):
        work, fin = reduce_work(pg, self.tensor, self.name, len(active))
        return work, lambda: [fin()]

    def apply(self, result) -> None:
        self.tensor.copy_(result[0])


class Reduce(AllReduce):
    """reduce to slot `root`: an all_reduce (fetchable, redoable) whose result only the
    root keeps; every other rank's tensor is left as it was."""

    kind = "reduce"

    def __init__(self, tensor: torch.Tensor, op, root: int, slot: int) -> None:
        super().__init__(tensor, op)
        self.root, self.slot = root, slot

    def apply(self, result) -> None:
        if self.slot == self.root:
            self.tensor.copy_(result[0])


class ReduceScatter(AllReduce):
    """reduce_scatter_tensor: input [max_size * n, ...] -> output [n, ...] of our slot.

    An all_reduce of the whole input (fetchable, redoable, its dtype and op checked the
    same way) of which each rank keeps its slot's rows.
    """

    kind = "reduce_scatter"

    def __init__(self, output: torch.Tensor, input: torch.Tensor, op, slot: int, size: int):
        if input.shape[0] != output.shape[0] * size:
            raise ValueError(f"reduce_scatter input dim0 {input.shape[0]} != "
                             f"{size} x output dim0 {output.shape[0]}")
        super().__init__(input, op)
        self.output, self.slot = output, slot

    def apply(self, result) -> None:
        n = self.output.shape[0]
        self.output.copy_(result[0][self.slot * n:(self.slot + 1) * n])


class Broadcast:
    kind, fetchable = "broadcast", True

    def __init__(self, tensor: torch.Tensor, root: int, slot: int) -> None:
        self.tensor, self.root, self.slot = tensor, root, slot

    def redoable(self, active) -> bool:
        return self.root in active  # a dead source cannot be replaced

    def start(self, pg, active):
        if self.root not in active:
            raise ValueError(f"broadcast root {self.root} is not active (active={list(active)})")
        buf = self.tensor.detach().clone()
        opts = dist.BroadcastOptions()
        opts.rootRank = active.index(self.root)
        work = pg.broadcast([_bytes(buf)], opts)
        return work, lambda: [buf]

    def apply(self, result) -> None:
        if self.slot != self.root:
            self.tensor.copy_(result[0])


class Scatter(Broadcast):
    """scatter from slot `root`: the root broadcasts its max_size tensors stacked (so the
    op is fetchable), and each rank keeps its own slot's one.

    inputs: the root's list of max_size tensors shaped like `output`; [] elsewhere.
    """

    kind = "scatter"

    def __init__(self, output: torch.Tensor, inputs: list[torch.Tensor], root: int, slot: int,
                 size: int) -> None:
        if slot == root:
            if len(inputs) != size:
                raise ValueError(f"scatter needs {size} input tensors at the root, got "
                                 f"{len(inputs)}")
            stacked = torch.stack([t.to(output.dtype) for t in inputs])
        else:
            stacked = output.new_empty((size, *output.shape))
        super().__init__(stacked, root, slot)
        self.output = output

    def apply(self, result) -> None:
        self.output.copy_(result[0][self.slot])


class AllGather:
    """all_gather into a list of max_size tensors; inactive slots are zero-filled."""

    kind, fetchable = "all_gather", True

    def __init__(self, outputs: list[torch.Tensor], input: torch.Tensor) -> None:
        self.outputs, self.input = outputs, input

    def redoable(self, active) -> bool:
        return True

    def start(self, pg, active):
        bufs = [torch.empty_like(self.input) for _ in active]
        work = pg.allgather([[_bytes(b) for b in bufs]], [_bytes(self.input.detach().clone())])

        def finalize():
            full = [torch.zeros_like(self.input) for _ in self.outputs]
            for s, b in zip(active, bufs, strict=True):
                full[s] = b
            return full

        return work, finalize

    def apply(self, result) -> None:
        for o, r in zip(self.outputs, result, strict=True):
            o.copy_(r)


class Gather(AllGather):
    """gather to slot `root`: an all_gather (fetchable) whose result only the root keeps.

    outputs: the root's list of max_size tensors (inactive slots zero-filled); [] elsewhere.
    """

    kind = "gather"

    def __init__(self, outputs: list[torch.Tensor], input: torch.Tensor, root: int, slot: int,
                 size: int) -> None:
        if slot == root and len(outputs) != size:
            raise ValueError(f"gather needs {size} output tensors at the root, got "
                             f"{len(outputs)}")
        # non-roots gather into throwaway tensors of the input's shape
        super().__init__(outputs if slot == root else [input] * size, input)
        self.root, self.slot = root, slot

    def apply(self, result) -> None:
        if self.slot == self.root:
            super().apply(result)


class AllGatherInto(AllGather):
    """all_gather_into_tensor: output [max_size * n, ...]; inactive chunks zero."""

    kind = "all_gather_into_tensor"

    def __init__(self, output: torch.Tensor, input: torch.Tensor, size: int) -> None:
        if output.shape[0] != input.shape[0] * size:
            raise ValueError(f"all_gather output dim0 {output.shape[0]} != {size} x "
                             f"{input.shape[0]}")
        super().__init__(list(output.chunk(size)), input)


class Barrier:
    kind, fetchable = "barrier", True

    def redoable(self, active) -> bool:
        return True

    def start(self, pg, active):
        return pg.allreduce([torch.zeros(1)]), lambda: []

    def apply(self, result) -> None:
        pass


class AllToAll:
    """all_to_all_single with per-slot splits over max_size slots (never fetch/redo).

    Inactive slots must get zero splits; without explicit splits dim0 is divided evenly
    over max_size slots and inactive slots' chunks are skipped (their output rows zero).
    """

    kind, fetchable = "all_to_all_single", False

    def __init__(self, output, input, out_splits, in_splits, size: int) -> None:
        self.output, self.input, self.size = output, input, size
        if not out_splits:
            out_splits = [output.shape[0] // size] * size
        if not in_splits:
            in_splits = [input.shape[0] // size] * size
        if len(out_splits) != size or len(in_splits) != size:
            raise ValueError(f"all_to_all_single needs {size} splits (max group size)")
        if sum(out_splits) != output.shape[0] or sum(in_splits) != input.shape[0]:
            raise ValueError("all_to_all_single split sizes do not add up to dim0")
        self.out_splits, self.in_splits = list(out_splits), list(in_splits)

    def redoable(self, active) -> bool:
        return False

    def _offsets(self, splits):
        offs, o = [], 0
        for s in splits:
            offs.append(o)
            o += s
        return offs

    def start(self, pg, active):
        osz = [self.out_splits[s] for s in active]
        isz = [self.in_splits[s] for s in active]
        if len(active) == self.size and self.output.is_cuda and self.output.is_contiguous():
            # CUDA: NCCL writes the caller's tensor directly. Safe, unlike Gloo: the
            # caller's stream is ordered after this work (or after its abort), so an
            # abandoned op can never write into it behind the caller's back.
            work = pg.alltoall_base(_bytes(self.output), _bytes(self.input.contiguous()), osz,
                                    isz, dist.AllToAllOptions())
            return work, lambda: [self.output]
        out = self.output.new_empty((sum(osz), *self.output.shape[1:]))
        if len(active) == self.size:
            # No holes: Gloo only reads the input, so it is used as is; the private
            # output is the result (an abandoned op may still write into it).
            work = pg.alltoall_base(_bytes(out), _bytes(self.input.contiguous()), osz, isz,
                                    dist.AllToAllOptions())
            return work, lambda: [out]
        ioff = self._offsets(self.in_splits)
        ooff = self._offsets(self.out_splits)
        inp = torch.cat([self.input[ioff[s]:ioff[s] + self.in_splits[s]] for s in active])
        work = pg.alltoall_base(_bytes(out), _bytes(inp.contiguous()), osz, isz,
                                dist.AllToAllOptions())

        def finalize():
            full = torch.zeros_like(self.output)
            o = 0
            for s, n in zip(active, osz, strict=True):
                full[ooff[s]:ooff[s] + n] = out[o:o + n]
                o += n
            return [full]

        return work, finalize

    def apply(self, result) -> None:
        if result[0] is not self.output:
            self.output.copy_(result[0])
