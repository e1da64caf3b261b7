"""The FP8 decode kernels compiled on the GPU with the tiles this device's shipped table
gives (:mod:`elasticep.moe.experts.fp8_tiles`; the defaults where it has none),
against their torch reference at Qwen3-30B-A3B's and DeepSeek-V3's expert shapes: what
ships is what is checked."""

from __future__ import annotations

import math

import pytest
import torch

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts import fp8_tiles as tiles
from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8, swiglu_rows_fp8_reference
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8
from elasticep_testkit.fp8_expert_check import rounding_bound, worst_ratio

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]
SLOTS = 16
SHAPES = [(2048, 768), (7168, 2048)]


def _case(hidden: int, inter: int, n: int, seed: int):
    """FP8 experts in packed slots (their views, as the engine passes them), bf16 rows
    and top-8-like tags, drawn on the GPU."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    packed = []
    for rows_, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(SLOTS, rows_, cols, device=dev, generator=gen) / cols ** 0.5
        packed.append(fp8_block.unpack(fp8_block.pack(*fp8_block.quantize(w)), rows_))
    rows = torch.randn(n, hidden, device=dev, generator=gen).bfloat16()
    picks = torch.rand(-(-n // 8), SLOTS, device=dev, generator=gen).argsort(dim=1)
    tags = (picks[:, :8].reshape(-1)[:n] + 1).to(torch.int32)
    return (*packed[0], *packed[1], rows, tags)


def _shipped_entries(hidden: int, inter: int) -> list[tiles.Entry]:
    name = torch.cuda.get_device_name()
    return [e for e in tiles.load_table(tiles.table_path(name))
            if (e.hidden, e.inter) == (hidden, inter)]


def _row_counts(family_kernels: tuple[str, ...], hidden: int, inter: int,
                decode: list[int]) -> list[int]:
    # the decode row counts, and one count inside each shipped bucket of these kernels
    per = SLOTS if family_kernels[0].startswith("fp8_sorted") else 1
    shipped = {max(1, math.ceil(e.bucket * per)) for e in _shipped_entries(hidden, inter)
               if e.kernel in family_kernels}
    return sorted(set(decode) | shipped)


@pytest.mark.parametrize("hidden, inter", SHAPES)
def test_fp8_rows_with_shipped_tiles_match_reference(hidden, inter):
    kernels = ("fp8_rows_gate_up", "fp8_rows_down")
    for n in _row_counts(kernels, hidden, inter, [1, 8, 16, 64]):
        case = _case(hidden, inter, n, seed=n)
        picked = tiles.launch_tiles(kernels, hidden, inter, n, SLOTS, case[-2].device)
        got = swiglu_rows_fp8(*case)  # no tiles given: the table's, as the engine runs
        ref = swiglu_rows_fp8_reference(*case)
        assert worst_ratio(got, ref, rounding_bound(*case)) <= 1, (n, picked)


@pytest.mark.parametrize("hidden, inter", SHAPES)
def test_fp8_sorted_with_shipped_tiles_match_reference(hidden, inter):
    kernels = ("fp8_sorted_gate_up", "fp8_sorted_down")
    for n in _row_counts(kernels, hidden, inter, [32, 128]):
        case = _case(hidden, inter, n, seed=n)
        picked = tiles.launch_tiles(kernels, hidden, inter, n, SLOTS, case[-2].device)
        got = swiglu_sorted_fp8(*case)
        ref = swiglu_rows_fp8_reference(*case)
        assert worst_ratio(got, ref, rounding_bound(*case)) <= 1, (n, picked)


def test_every_shipped_entry_of_this_device_runs_within_the_bound():
    # each shipped tile at its own shape, forced (a bucket above the decode counts too)
    name = torch.cuda.get_device_name()
    for e in tiles.load_table(tiles.table_path(name)):
        sorted_kernel = e.kernel in tiles.SORTED_KERNELS
        n = max(1, math.ceil(e.bucket * (SLOTS if sorted_kernel else 1)))
        case = _case(e.hidden, e.inter, n, seed=n)
        pair = tiles.SORTED_KERNELS if sorted_kernel else tiles.ROWS_KERNELS
        forced = tuple(e.tile if k == e.kernel else tiles.DEFAULTS[k] for k in pair)
        fn = swiglu_sorted_fp8 if sorted_kernel else swiglu_rows_fp8
        got = fn(*case, tiles=forced)
        ref = swiglu_rows_fp8_reference(*case)
        assert worst_ratio(got, ref, rounding_bound(*case)) <= 1, e
