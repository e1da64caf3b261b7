"""MLA's whole-prompt prefill as one padded SDPA call on the GPU (CI has no GPU).

At DeepSeek-V2-Lite's MLA widths (16 heads, r 512, dn 128, dr 64, dv 128, hidden 2048,
plain q_proj), bf16 on CUDA, the padded batch (:func:`elasticep.models.mla._padded_prompts`,
SDPA's fused kernels over a causal ``[B, L]`` grid) against the torch reference: one
call per sequence in fp32 on the same weights. The time of both paths at 16 x 128 and
4 x 512 tokens is printed (``-s``), one layer, for the lead's table.
"""

from __future__ import annotations

import time

import pytest
import torch

from elasticep.models.layers import AttentionMetadata
from elasticep.models.mla import MLAConfig, MLAWeights, mla_attention, padded_prefill_ok
from elasticep.models.rope import RopeConfig, rope_cos_sin

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]

CFG = MLAConfig(num_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128)
HIDDEN = 2048


def _weights(dtype: torch.dtype) -> MLAWeights:
    g = torch.Generator(device="cuda").manual_seed(0)
    c = CFG

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda") / shape[-1] ** 0.5).to(dtype)

    return MLAWeights(q=rnd(c.num_heads * c.qk_head_dim, HIDDEN), kv_a=rnd(c.cache_width, HIDDEN),
                      kv_a_norm=torch.ones(c.kv_lora_rank, device="cuda", dtype=dtype),
                      kv_b=rnd(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
                      o=rnd(HIDDEN, c.num_heads * c.v_head_dim))


def _inputs(lens: list[int], dtype: torch.dtype):
    T = sum(lens)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    meta = AttentionMetadata(starts, list(lens), torch.arange(T, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, HIDDEN, generator=g, device="cuda").to(dtype)
    rope = RopeConfig()
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])
    cos, sin = rope_cos_sin(rope, pos, CFG.qk_rope_head_dim, dtype)
    return x, cos, sin, meta


@pytest.mark.parametrize("lens", [[128] * 16, [512] * 4, [300, 200, 100, 37], [5] * 40])
def test_padded_prefill_matches_per_sequence_reference(lens):
    scale = CFG.qk_head_dim ** -0.5
    x, cos, sin, meta = _inputs(lens, torch.bfloat16)
    got = mla_attention(x, _weights(torch.bfloat16), CFG, cos, sin, None, meta, scale, 1e-6,
                        padded=True)
    x32, cos32, sin32, meta32 = _inputs(lens, torch.float32)
    want = mla_attention(x32, _weights(torch.float32), CFG, cos32, sin32, None, meta32, scale,
                         1e-6, padded=False)
    err = float((got.float() - want).norm() / want.norm())
    assert err < 2e-2, err


@pytest.mark.parametrize("lens", [[128] * 16, [512] * 4])
def test_padded_prefill_time(lens):
    assert padded_prefill_ok(lens)
    w, scale = _weights(torch.bfloat16), CFG.qk_head_dim ** -0.5
    x, cos, sin, meta = _inputs(lens, torch.bfloat16)
    times, outs = {}, {}
    for padded in (False, True, False, True):
        for _ in range(3):
            outs[padded] = mla_attention(x, w, CFG, cos, sin, None, meta, scale, 1e-6,
                                         padded=padded)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            mla_attention(x, w, CFG, cos, sin, None, meta, scale, 1e-6, padded=padded)
        torch.cuda.synchronize()
        times[padded] = (time.perf_counter() - t0) / 20 * 1e3
    print(f"MLA prefill layer, {len(lens)} x {lens[0]}: per sequence {times[False]:.3f} ms, "
          f"padded {times[True]:.3f} ms")
    # what was timed is the same attention both ways: two bf16 paths that round
    # differently (one SDPA call against one per sequence), a few bf16 units apart
    err = float((outs[True].float() - outs[False].float()).norm() / outs[False].float().norm())
    assert outs[True].shape == (sum(lens), HIDDEN) and err < 2e-2, err
    assert times[True] > 0 and times[False] > 0
