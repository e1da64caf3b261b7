"""Prefill logits of the demo model on the GPU against its CPU path (issue 28, item 5;
GPU only: CI has no GPU).

Every position's logits of one prefill step of several whole prompts, on CUDA (the
Triton norm/RoPE/KV-cache kernels, flash or paged attention, the tiled or sorted-rows
experts in bf16) against the same step on CPU in fp32 (the torch references, which
test_models_families.py checks against transformers). Three compositions: equal long
prompts (one batched SDPA call; 6,600 expert pairs, so the tiled experts reading each
token's row for its two pairs), mixed lengths (the paged kernel) and many short prompts.

- fp32 on CUDA: to rounding (the expert kernels refuse fp32, so this checks the rest);
- bf16 on CUDA: norm-wise relative error within bf16's reach and the same argmax at
  nearly every position (a wrong row or slot gives errors of order 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _ckpt_copy import linked_checkpoint
from _model_helpers import engine_prefill_logits

from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]

CASES = {"equal_long": [1100] * 3, "mixed": [700, 300, 1500], "short": [128] * 16}


@pytest.fixture(scope="module")
def demo_4k(tmp_path_factory) -> Path:
    """The demo checkpoint with a 4096-token context (its own is 1024), weights linked."""
    return linked_checkpoint(DEMO_MODEL, tmp_path_factory.mktemp("demo4k"), "config.json",
                             lambda cfg: {**cfg, "max_position_embeddings": 4096})


def step_logits(model_dir: Path, device: str, dtype: torch.dtype,
                lengths: list[int]) -> torch.Tensor:
    """``[sum(lengths), V]`` float32 logits (on CPU) of one prefill step of random whole
    prompts of ``lengths`` tokens (fixed seed)."""
    eng = LLMEngine.from_pretrained(model_dir, dtype=dtype, device=device, progress=False,
                                    config=EngineConfig(max_total_tokens=8192, max_num_seqs=32,
                                                        max_batch_tokens=8192,
                                                        enable_cuda_graph=False))
    return engine_prefill_logits(eng, lengths, 8000)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_on_cuda_match_the_cpu_path(demo_4k, case):
    lengths = CASES[case]
    ref = step_logits(demo_4k, "cpu", torch.float32, lengths)
    assert ref.shape[0] == sum(lengths)
    f32 = step_logits(demo_4k, "cuda", torch.float32, lengths)
    err32 = float((f32 - ref).abs().max() / ref.abs().max())
    assert err32 < 1e-3, (case, err32)
    bf16 = step_logits(demo_4k, "cuda", torch.bfloat16, lengths)
    norm_err = float((bf16 - ref).norm() / ref.norm())
    same_top = float((bf16.argmax(-1) == ref.argmax(-1)).float().mean())
    print(f"{case}: fp32 max rel {err32:.2e}; bf16 norm rel {norm_err:.3e}, "
          f"argmax agreement {same_top:.4f}")
    assert norm_err < 5e-2 and same_top > 0.9, (case, norm_err, same_top)
