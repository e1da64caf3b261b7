"""The workloads of the FP8 decode tile sweep (``bench/fp8_decode_sweep.py``): random
FP8 experts in packed slots, top-k-like slot tags, and one (shape, rows) case with its
reference, its rounding bound and the slot sets its launches rotate over."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_rows import (
    down_rows_fp8,
    gate_up_rows_fp8,
    swiglu_rows_fp8_reference,
)
from elasticep.moe.experts.fp8_sorted import down_sorted_fp8, gate_up_sorted_fp8
from elasticep.moe.experts.fp8_tiles import DEFAULTS, Tile
from elasticep.moe.experts.sorted_experts import slot_order
from elasticep_testkit.fp8_expert_check import rounding_bound

TOP_K = 8


@dataclass
class Case:
    """One (shape, rows) workload: ``sets`` slot-tag sets (``[N]`` int32 each), the
    first one checked, all of them timed in turn; the rows, the check's reference and
    bound, and the intermediate the down kernels read."""

    family: str  # "rows" or "sorted"
    hidden: int
    inter: int
    slots: int
    rows: torch.Tensor
    sets: list[torch.Tensor]
    groupings: list
    ref: torch.Tensor
    bound: torch.Tensor
    act: torch.Tensor  # the default gate/up kernel's result on sets[0]


def expert_slots(hidden: int, inter: int, slots: int, dev: torch.device,
                 seed: int) -> tuple[torch.Tensor, ...]:
    """Random FP8 experts as the engine holds them: packed slots (weights and scales in
    one uint8 tensor), returned as their unpacked views ``(w13, s13, w2, s2)``; made a
    few slots at a time so the float32 draws stay small."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    p13 = torch.empty(slots, fp8_block.packed_rows(2 * inter, hidden), hidden,
                      dtype=torch.uint8, device=dev)
    p2 = torch.empty(slots, fp8_block.packed_rows(hidden, inter), inter, dtype=torch.uint8,
                     device=dev)
    step = 8
    for s0 in range(0, slots, step):
        n = min(step, slots - s0)
        w = torch.randn(n, 2 * inter, hidden, device=dev, generator=gen) / hidden ** 0.5
        fp8_block.pack(*fp8_block.quantize(w), out=p13[s0:s0 + n])
        w = torch.randn(n, hidden, inter, device=dev, generator=gen) / inter ** 0.5
        fp8_block.pack(*fp8_block.quantize(w), out=p2[s0:s0 + n])
    return (*fp8_block.unpack(p13, 2 * inter), *fp8_block.unpack(p2, hidden))


def topk_tags(n: int, slots: int, gen: torch.Generator, dev: torch.device) -> torch.Tensor:
    """``[n]`` int32 tags ``slot + 1``: each run of ``TOP_K`` rows (a token's pairs; fewer
    when there are fewer slots) on distinct random slots."""
    k = min(TOP_K, slots)
    picks = torch.rand(-(-n // k), slots, generator=gen, device=dev).argsort(dim=1)
    return (picks[:, :k].reshape(-1)[:n] + 1).to(torch.int32)


def slot_bytes(w: torch.Tensor, s: torch.Tensor) -> int:
    """Bytes one slot's weight and its scales take."""
    return w[0].numel() * w.element_size() + s[0].numel() * s.element_size()


def launch_sets(bytes_per_launch: float, dev: torch.device) -> int:
    """How many launches (each on its own slot set) one timed graph holds: enough that
    their bytes overflow the L2 cache four times, 2 to 64."""
    if dev.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    return max(2, min(64, math.ceil(4 * l2 / max(bytes_per_launch, 1))))


def make_case(family: str, experts: tuple, n: int, dtype: torch.dtype,
              dev: torch.device, seed: int) -> Case:
    """The workload of ``n`` rows for the ``family`` kernels on ``experts``."""
    w13, s13, w2, s2 = experts
    slots, inter, hidden = w13.shape[0], w2.shape[2], w2.shape[1]
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = torch.randn(n, hidden, device=dev, generator=gen).to(dtype)
    first = topk_tags(n, slots, gen, dev)
    touched = int(first.unique().numel())
    per_launch = touched * (slot_bytes(w13, s13) + slot_bytes(w2, s2)) / 2
    sets = [first] + [topk_tags(n, slots, gen, dev)
                      for _ in range(launch_sets(per_launch, dev) - 1)]
    groupings = [slot_order(t, slots) for t in sets] if family == "sorted" else []
    ref = swiglu_rows_fp8_reference(w13, s13, w2, s2, rows, first.long())
    bound = rounding_bound(w13, s13, w2, s2, rows, first)
    case = Case(family, hidden, inter, slots, rows, sets, groupings, ref, bound,
                rows.new_empty(n, inter))
    gate_up(case, experts, 0, case.act, DEFAULTS[f"fp8_{family}_gate_up"])
    return case


def gate_up(case: Case, experts: tuple, j: int, act: torch.Tensor, tile: Tile) -> None:
    """The gate/up kernel of the case's family on slot set ``j`` with ``tile``."""
    w13, s13 = experts[:2]
    if case.family == "rows":
        gate_up_rows_fp8(w13, s13, case.rows, case.sets[j], act, tile)
    else:
        gate_up_sorted_fp8(w13, s13, case.rows, case.groupings[j], act, tile)


def down(case: Case, experts: tuple, j: int, act: torch.Tensor, out: torch.Tensor,
         tile: Tile) -> None:
    """The down kernel of the case's family on slot set ``j`` with ``tile``."""
    w2, s2 = experts[2:]
    if case.family == "rows":
        down_rows_fp8(act, case.sets[j], w2, s2, out, tile)
    else:
        down_sorted_fp8(act, case.groupings[j], w2, s2, out, tile)
