"""A rank's limits sized like SGLang's (engine/limits.py), with real model shapes: the
arithmetic on CPU, the limits of a scale joiner, and what the rank reports."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from elasticep.config import DeploymentConfig
from elasticep.engine import limits as L
from elasticep.engine.cuda_graph import capture_buckets
from elasticep.eplb import initial_placement
from elasticep.membership.status import DeploymentStatus, RankStatus
from elasticep.membership.transitions import SlotState
from elasticep.models.config import load_model_config

REPO = Path(__file__).resolve().parents[1]
H200_BYTES = 143771 * 2**20  # torch.cuda.mem_get_info()[1] on an H200
DENSE_BYTES = 3 * 2**30  # Qwen3-30B-A3B's non-expert weights in bf16, about 3 GiB


def _config(tmp_path: Path, name: str):
    shutil.copy(REPO / "bench" / "configs" / f"{name}.json", tmp_path / "config.json")
    return load_model_config(tmp_path)


@pytest.fixture
def qwen3(tmp_path):
    return _config(tmp_path, "qwen3-30b-a3b")


def test_bytes_per_token_and_per_expert_slot_of_real_shapes(qwen3, tmp_path):
    # 48 layers x (K + V) x 4 kv heads x 128 x 2 bytes
    assert L.kv_bytes_per_token(qwen3, torch.bfloat16) == 48 * 2 * 4 * 128 * 2 == 98304
    assert L.kv_bytes_per_token(qwen3, torch.float32) == 2 * 98304
    # 48 MoE layers x (gate + up + down) x 2048 x 768 x 2 bytes
    assert L.expert_bytes_per_slot(qwen3, torch.bfloat16) == 452_984_832
    v3 = _config(tmp_path, "deepseek-v3")  # MLA: one latent row of 512 + 64 per layer
    assert L.kv_bytes_per_token(v3, torch.bfloat16) == 61 * 576 * 2


def test_an_h200_sized_for_qwen3_alone_and_shared_by_two_ranks(qwen3):
    per_token = L.kv_bytes_per_token(qwen3, torch.bfloat16)
    expert = L.expert_bytes_per_slot(qwen3, torch.bfloat16)
    # EP1: 0.85 x 143771 MiB = 122205 MiB, less 57 GiB of weights: 42557 blocks of 16
    # tokens (one block left for the CUDA graphs' sink)
    assert L.kv_tokens_for_memory(H200_BYTES, 0.85, 1, DENSE_BYTES + 128 * expert,
                                  per_token) == 680_912
    # two ranks on one GPU halve the share; each holds half the experts
    assert L.kv_tokens_for_memory(H200_BYTES, 0.85, 2, DENSE_BYTES + 64 * expert,
                                  per_token) == 324_064
    with pytest.raises(ValueError, match=r"^--mem-fraction-static 0.3: this rank's share, "
                                         r"43131 MiB \(1 rank\(s\) on a 143771 MiB GPU\), "
                                         r"does not hold its 58368 MiB of weights"):
        L.kv_tokens_for_memory(H200_BYTES, 0.3, 1, DENSE_BYTES + 128 * expert, per_token)


@pytest.mark.parametrize("rank, max_ep_size, gpus, sharing", [
    (0, 1, 1, 1), (3, 4, 8, 1), (0, 12, 8, 2), (5, 12, 8, 1), (2, 6, 2, 3), (1, 2, 1, 2),
])
def test_ranks_sharing_a_gpu_count_every_slot_of_the_capacity(rank, max_ep_size, gpus,
                                                              sharing):
    assert L.ranks_sharing_gpu(rank, max_ep_size, gpus) == sharing


def test_default_running_requests_follow_the_kv_cache_on_cuda_only():
    assert L.default_max_running_requests("cuda", 680_912) == 1024  # the cap
    assert L.default_max_running_requests("cuda", 200_000) == 781  # 200000 // 256
    assert L.default_max_running_requests("cuda", 100) == 1
    assert L.default_max_running_requests("cpu", 680_912) == 64


def test_cpu_keeps_its_defaults_and_flags_override():
    cpu = L.rank_limits(DeploymentConfig(model="/m"), None)
    assert cpu == L.RankLimits(8192, 64, 256, None)
    cuda = DeploymentConfig(model="/m", device="cuda", max_total_tokens=200_000)
    assert L.rank_limits(cuda, None) == L.RankLimits(200_000, 781, 256, 8192)
    fixed = DeploymentConfig(model="/m", device="cuda", max_running_requests=96,
                             chunked_prefill_size=-1)
    assert L.rank_limits(fixed, 680_912) == L.RankLimits(680_912, 96, 96, None)
    graphs = DeploymentConfig(model="/m", device="cuda", cuda_graph_max_bs=32,
                              chunked_prefill_size=2048)
    assert L.rank_limits(graphs, 680_912) == L.RankLimits(680_912, 1024, 32, 2048)
    engine = L.rank_limits(graphs, 680_912).engine_config(enable_cuda_graph=False)
    assert (engine.max_total_tokens, engine.max_num_seqs, engine.cuda_graph_max_bs,
            engine.chunked_prefill_size, engine.enable_cuda_graph) == (680_912, 1024, 32,
                                                                       2048, False)
    # the step's prefill budget: the engine's default, raised to the chunk size
    assert engine.max_batch_tokens == 4096
    assert L.rank_limits(DeploymentConfig(model="/m", device="cuda"), 680_912).engine_config(
    ).max_batch_tokens == 8192


def test_a_scale_joiner_gets_the_launch_ranks_exchange_and_its_own_kv_share(qwen3):
    """Launch: ranks 0-1 on a 2-GPU host, capacity 4 (slots 2-3 share GPUs 0-1 later).
    The joiner reads the config from the coordinator (JSON), loads no expert, and must
    end with the exchange buckets of the launch ranks and a KV share that leaves room
    for the experts its peers will send."""
    launch = DeploymentConfig(model="/m", dtype="bfloat16", device="cuda", ep_size=2,
                              max_ep_size=4, mem_fraction_static=0.85)
    joiner_cfg = DeploymentConfig.from_json(launch.to_json())
    expert = L.expert_bytes_per_slot(qwen3, torch.bfloat16)
    slots = initial_placement(48, 128, 0, 2, 4).slots_per_rank  # what a rank hosts
    assert slots == 64
    rank0 = L.kv_tokens_of_rank(launch, qwen3, 0, L.GpuMemory(H200_BYTES,
                                                              DENSE_BYTES + slots * expert, 2))
    joiner = L.kv_tokens_of_rank(joiner_cfg, qwen3, 2, L.GpuMemory(H200_BYTES, DENSE_BYTES, 2),
                                 missing_expert_slots=slots)
    assert rank0 == joiner == 324_064  # two slots (0 and 2) on GPU 0
    a, b = L.rank_limits(launch, rank0), L.rank_limits(joiner_cfg, joiner)
    assert a == b == L.RankLimits(324_064, 1024, 256, 8192)
    # the joiner's buckets equal the launch ranks', even with another KV share
    smaller = L.rank_limits(joiner_cfg, 50_000)
    assert smaller.max_running_requests == 195
    assert capture_buckets(smaller.cuda_graph_max_bs) == capture_buckets(a.cuda_graph_max_bs)


def test_status_shows_each_ranks_reported_limits():
    status = DeploymentStatus(3, 2, 2, ranks=(RankStatus(0, SlotState.HEALTHY, 11, 0),
                                              RankStatus(1, SlotState.HEALTHY, 12, 0)))
    shown = status.with_running({0: 5}, {0: (324_064, 1024)})
    body = shown.to_dict()["ranks"]
    assert body[0] == {"rank": 0, "state": "healthy", "pid": 11, "node": 0,
                       "running_requests": 5, "max_total_tokens": 324_064,
                       "max_running_requests": 1024}
    assert body[1] == {"rank": 1, "state": "healthy", "pid": 12, "node": 0,
                       "running_requests": 0}  # no hello yet: no limits shown
    assert DeploymentStatus.from_dict(shown.to_dict()) == shown
    # the transport a rank reported in its hello (/elastic_ep_status names it)
    told = status.with_running({}, {0: (324_064, 1024)}, {0: "cuda_ipc"})
    assert told.to_dict()["ranks"][0]["moe_a2a_backend"] == "cuda_ipc"
    assert "moe_a2a_backend" not in told.to_dict()["ranks"][1]
    assert DeploymentStatus.from_dict(told.to_dict()) == told
