"""GPU data plane: grouped-GEMM experts, the padded exchange on CUDA, NCCL epochs.

Skipped without CUDA (CI has none); the CPU side of the same logic is covered by
tests/test_moe_padded_exchange.py. The 2-GPU test runs bench/gpu_run.py's
multi-process sections (elastic backend over NCCL, kill + rejoin) in quick mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elasticep.moe.exchange.padded_exchange import pair_capacity, plan_padded
from elasticep.moe.experts.expert_compute import grouped_swiglu, run_expert_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [8, 256])
def test_grouped_swiglu_matches_fp32_reference(n):
    dev = torch.device("cuda")
    S, H, inter = 8, 256, 128
    w13 = (torch.randn(S, 2 * inter, H, device=dev) * 0.05).bfloat16()
    w2 = (torch.randn(S, H, inter, device=dev) * 0.05).bfloat16()
    rows = torch.randn(n, H, device=dev).bfloat16()
    tags = torch.randint(0, S + 1, (n,), device=dev, dtype=torch.int32)
    tags[0] = 1  # at least one real row
    got = grouped_swiglu(w13, w2, rows, tags).float()
    valid = tags > 0
    ref = torch.zeros(n, H, device=dev)
    ref[valid] = run_expert_rows(w13.float(), w2.float(), rows[valid].float(),
                                 tags[valid].long() - 1)
    assert torch.isfinite(got).all()
    assert float((got - ref).norm() / ref.norm()) < 1e-2
    assert torch.count_nonzero(got[~valid]) == 0


def test_plan_on_cuda_equals_cpu():
    S, G, T, k = 4, 2, 9, 2
    slots = torch.stack([torch.randperm(G * S)[:k] for _ in range(T)])
    C = pair_capacity(T, k, S)
    a, b = plan_padded(slots, S, G, C), plan_padded(slots.cuda(), S, G, C)
    assert torch.equal(a.position, b.position.cpu()) and torch.equal(a.tag, b.tag.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.timeout(300)
def test_two_gpu_nccl_epochs(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "bench.gpu_run", "--quick", "--only", "nccl,kill",
                    "--out", str(tmp_path)], cwd=ROOT, env=env, check=True, timeout=280)
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    for r in ("rank0", "rank1"):
        assert res["nccl"][r]["all_reduce_fp32_ok"] and res["nccl"][r]["all_to_all_ok"]
        assert res["nccl"][r]["ep2_moe_rel_err_bf16"] < 1e-2
        # the steady-state all_to_all takes the fast path from the second call on
        assert res["nccl"][r]["all_to_all_uneven_ok"]
        assert res["nccl"][r]["fast_path_after_first_op"][1]
    assert res["kill"]["interruption_s"] is not None and res["kill"]["interruption_s"] < 5
    assert res["kill"]["rejoin_pause_s"] is not None
