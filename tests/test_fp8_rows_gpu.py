"""The FP8 decode expert kernels compiled on the GPU against their torch reference, at
Qwen3-30B-A3B's and DeepSeek-V3's expert shapes (bf16 activations)."""

from __future__ import annotations

import pytest
import torch
from test_fp8_rows import make_case, packed_case, rounding_bound

from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.fp8_block import pack
from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8, swiglu_rows_fp8_reference
from elasticep.moe.experts.fp8_sorted import swiglu_sorted_fp8

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]


@pytest.mark.parametrize("hidden, inter, rows", [(2048, 768, 8), (2048, 768, 64),
                                                  (7168, 2048, 8), (160, 72, 5)])
def test_fp8_rows_match_reference_on_gpu(hidden, inter, rows):
    case = [t.cuda() for t in make_case(16, hidden, inter, rows, torch.bfloat16, seed=hidden)]
    got = swiglu_rows_fp8(*case).float()
    ref = swiglu_rows_fp8_reference(*case).float()
    assert not got[0].any()  # the padding row
    bound = rounding_bound(*[t.cpu() for t in case])  # see its docstring
    assert float(((got.cpu() - ref.cpu()).abs() / bound).max()) <= 1


@pytest.mark.parametrize("hidden, inter, rows", [(2048, 768, 128), (2048, 768, 2048),
                                                  (160, 128, 40)])
def test_fp8_sorted_rows_match_reference_on_gpu(hidden, inter, rows):
    case = [t.cuda() for t in packed_case(16, hidden, inter, rows, torch.bfloat16, seed=rows)]
    got = swiglu_sorted_fp8(*case).float().cpu()
    ref = swiglu_rows_fp8_reference(*case).float().cpu()
    bound = rounding_bound(*[t.cpu() for t in case])
    assert float(((got - ref).abs() / bound).max()) <= 1


def test_grouped_swiglu_on_packed_slots_picks_the_fp8_kernels():
    w13, s13, w2, s2, rows, tags = (t.cuda() for t in make_case(8, 256, 128, 96, torch.bfloat16))
    p13, p2 = pack(w13, s13), pack(w2, s2)
    ref = swiglu_rows_fp8_reference(w13, s13, w2, s2, rows, tags).float().cpu()
    bound = rounding_bound(*[t.cpu() for t in (w13, s13, w2, s2, rows, tags)])
    for n in (8, 96):  # the per-row kernels, then the sorted ones
        got = grouped_swiglu(p13, p2, rows[:n], tags[:n]).float().cpu()
        assert float(((got - ref[:n]).abs() / bound[:n]).max()) <= 1, n
