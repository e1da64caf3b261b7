"""The FP8 decode expert kernels compiled on the GPU against their torch reference, at
Qwen3-30B-A3B's and DeepSeek-V3's expert shapes (bf16 activations)."""

from __future__ import annotations

import pytest
import torch
from test_fp8_rows import make_case, rounding_bound

from elasticep.moe.experts.fp8_rows import swiglu_rows_fp8, swiglu_rows_fp8_reference

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
