"""GPU sampling equals CPU sampling: same noise bits, same ids for the same logits."""

from __future__ import annotations

import pytest
import torch

from elasticep.engine.request import SamplingParams
from elasticep.engine.sampler import rng_key, sample_batch, uniform_noise

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]


def test_noise_bits_identical_on_cuda():
    keys = torch.tensor([rng_key(f"r{i}", None, i) for i in range(64)])
    cpu = uniform_noise(keys, 151_936)
    gpu = uniform_noise(keys.cuda(), 151_936).cpu()
    assert torch.equal(cpu, gpu)


def test_sampled_ids_identical_on_cuda_and_timed():
    g = torch.Generator().manual_seed(0)
    B, V = 256, 151_936
    logits = (torch.randn(B, V, generator=g) * 4).float()
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 50][i % 2],
                             top_p=[1.0, 0.9][(i // 2) % 2], seed=i if i % 3 else None) for i in range(B)]
    rids, idx = [f"r{i}" for i in range(B)], list(range(B))
    want = sample_batch(logits, params, rids, idx)
    lg = logits.cuda()
    assert sample_batch(lg, params, rids, idx) == want
    for _ in range(3):
        sample_batch(lg, params, rids, idx)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        sample_batch(lg, params, rids, idx)
    end.record()
    torch.cuda.synchronize()
    print(f"\nsample_batch B={B} V={V} mixed params: {start.elapsed_time(end) / 10:.2f} ms/step")
