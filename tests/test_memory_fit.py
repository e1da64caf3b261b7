"""The start-up memory check (engine/memory_fit.py) with real shapes and GPU sizes on
CPU, and serve refusing, in one line with exit status 2, a deployment whose ranks cannot
fit their GPU, before it launches anything."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from elasticep.config import DeploymentConfig
from elasticep.engine import limits as L
from elasticep.engine import memory_fit as F
from elasticep.models.config import load_model_config

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
H100_BYTES = 81559 * 2**20  # an 80 GB H100's memory as torch reports it
PER_TOKEN = 98304  # Qwen3-30B-A3B's KV bytes per token in bf16


@pytest.fixture
def qwen3_dir(tmp_path):
    shutil.copy(REPO / "bench" / "configs" / "qwen3-30b-a3b.json", tmp_path / "config.json")
    return tmp_path


def test_weights_lower_bound_of_qwen3_counts_every_slot_and_the_dense_parts(qwen3_dir):
    c = load_model_config(qwen3_dir)
    expert = L.expert_bytes_per_slot(c, torch.bfloat16)
    # embedding + LM head (untied) + 48 routers + 48 x GQA q, k, v, o, in bf16
    dense = (151936 * 2048 * 2 + 48 * 128 * 2048
             + 48 * (2 * 2048 * 32 * 128 + 2 * 2048 * 4 * 128)) * 2
    assert dense == 3_081_764_864  # below the ~3 GiB a loaded rank measures: a lower bound
    assert F.weight_bytes_lower_bound(c, torch.bfloat16, 128) == dense + 128 * expert
    assert F.weight_bytes_lower_bound(c, torch.bfloat16, 64) == dense + 64 * expert


def test_two_slots_of_one_h100_cannot_hold_qwen3_without_a_fixed_kv_cache(qwen3_dir):
    """The issue's start-up: serve --ep-size 1 --max-ep-size 2 on one 80 GB H100."""
    c = load_model_config(qwen3_dir)
    d = DeploymentConfig(model=str(qwen3_dir), device="cuda", dtype="bfloat16",
                         ep_size=1, max_ep_size=2)
    problem = F.deployment_fit_problem(d, c, 128, H100_BYTES, gpu_count=1)
    assert problem == (
        "a rank's weights need at least 56.9 GiB (reserved expert slots included) but its "
        "share of its GPU is 33.9 GiB (0.85 of 79.6 GiB over 2 slot(s) on that GPU, "
        "--max-ep-size capacity included), leaving no KV cache; use more GPUs, a smaller "
        "--max-ep-size, a larger --min-ep-size (fewer reserved slots), a larger "
        "--mem-fraction-static, or size the cache with --max-total-tokens")
    # the sweep's form of it, with the engine's KV cache, fits the whole GPU
    fixed = DeploymentConfig(model=str(qwen3_dir), device="cuda", dtype="bfloat16",
                             ep_size=1, max_ep_size=2, max_total_tokens=131_424)
    assert F.deployment_fit_problem(fixed, c, 128, H100_BYTES, gpu_count=1) is None
    # one slot per GPU: the share holds the weights and a cache; two GPUs, one slot each
    assert F.deployment_fit_problem(DeploymentConfig(
        model=str(qwen3_dir), device="cuda", dtype="bfloat16"), c, 128, H100_BYTES, 1) is None
    assert F.deployment_fit_problem(d, c, 128, H100_BYTES, gpu_count=2) is None
    # CPU: nothing is sized from a GPU
    assert F.deployment_fit_problem(DeploymentConfig(model=str(qwen3_dir)), c, 128,
                                    H100_BYTES, 1) is None


def test_a_fixed_kv_cache_too_large_for_the_gpu_is_refused_with_its_numbers():
    w = 61_063_823_360  # Qwen3-30B-A3B with all 128 experts
    assert F.startup_fit_problem(H100_BYTES, 0.85, 1, 1, w, 200_000, PER_TOKEN) is None
    assert F.startup_fit_problem(H100_BYTES, 0.85, 1, 1, w, 400_000, PER_TOKEN) == (
        "1 rank(s) on one GPU need 93.5 GiB (each at least 56.9 GiB of weights, reserved "
        "expert slots included, and 36.6 GiB of KV cache for --max-total-tokens 400000) "
        "but the GPU has 79.6 GiB; use more GPUs, fewer --max-total-tokens, or a larger "
        "--min-ep-size")
    # two launch ranks on the GPU need twice as much
    assert F.startup_fit_problem(H100_BYTES, 0.85, 2, 2, w // 2, 200_000, PER_TOKEN) \
        is not None
    # the boundary: exactly the share is enough, one byte less is not
    share = int(H100_BYTES * 0.85)
    need = share - 2 * 16 * PER_TOKEN
    assert F.startup_fit_problem(H100_BYTES, 0.85, 1, 1, need, None, PER_TOKEN) is None
    assert F.startup_fit_problem(H100_BYTES, 0.85, 1, 1, need + 1, None, PER_TOKEN)


def test_serve_exits_2_in_one_line_before_launching(qwen3_dir, monkeypatch, capsys):
    from elasticep.entrypoints import serve_cmd
    from elasticep.entrypoints.cli import build_parser

    class H100:
        total_memory = H100_BYTES

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H100())
    launched = []
    monkeypatch.setattr(serve_cmd, "_serve_head", lambda *a: launched.append(a) or 0)
    args = build_parser("serve").parse_args(
        ["serve", "--model", str(qwen3_dir), "--device", "cuda", "--dtype", "bfloat16",
         "--load-format", "dummy", "--ep-size", "1", "--max-ep-size", "2",
         "--moe-a2a-backend", "all_to_all"])
    assert serve_cmd.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "elasticep serve: error: a rank's weights need at least 56.9 GiB"), err
    assert not launched
