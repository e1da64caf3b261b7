"""Piecewise decode CUDA graphs of the EP executor against its eager path (GPU only).

One GPU, one rank: the CUDA EP executor over a one-rank NCCL group, so every MoE layer
still goes dispatch -> grouped GEMM -> combine with real all_to_alls, which the graphs
leave eager between their pieces. Checked, for bf16 (grouped GEMM) and fp32 (the
all-slots path):
- every decode step's logits through the graphs equal the eager forward's;
- an idle step (no sequences, a bucket set by the agreed bound) replays too;
- a placement of the same shape is copied into the captured tensors (no capture, the
  graphs still follow the new placement); after a larger one the steps run eagerly
  while the graphs are captured again in a background thread, then replay again.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticep.elastic.placement_sync import commit_placement
from elasticep.elastic.rank_model import CheckpointExperts, attach_ep_executor, load_rank_weights
from elasticep.elastic.step_header import agreed_max_tokens
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.eplb.placement import Placement, initial_placement
from elasticep.models.config import load_model_config
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def nccl_world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ep_engine(tmp_path: Path, dtype: torch.dtype):
    shutil.copy(DEMO_MODEL / "config.json", tmp_path / "config.json")
    cfg = load_model_config(tmp_path)
    placement = initial_placement(cfg.num_hidden_layers, cfg.num_experts, 0, 1, 1)
    model = load_rank_weights(tmp_path, placement, 0, dtype, "cuda", load_format="dummy")
    ep, _ = attach_ep_executor(model, placement, 0, None, "static")
    eng = LLMEngine(model, EngineConfig(max_total_tokens=4096, max_num_seqs=8,
                                        forward_empty_batches=True, enable_cuda_graph=True))
    return eng, ep, CheckpointExperts(model, tmp_path, "dummy")


def _graph_vs_eager(eng: LLMEngine, ep, batch: ScheduledBatch, bound: int) -> float:
    with agreed_max_tokens(ep, bound):
        graph = eng.runner.forward(batch).clone()
        graphs, eng.runner.graphs = eng.runner.graphs, None
        eager = eng.runner.forward(batch)
        eng.runner.graphs = graphs
    assert graph.shape == eager.shape
    if not eager.numel():
        return 0.0
    return float((graph - eager).abs().max() / eager.abs().max())


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_ep_decode_graphs_equal_eager_through_placement_changes(tmp_path, nccl_world, dtype, tol):
    eng, ep, load_fn = _ep_engine(tmp_path, dtype)
    g = eng.runner.graphs
    assert g is not None and ep.token_buckets == tuple(g.buckets)
    pieces = g._graphs[g.buckets[-1], None].num_pieces
    # two exchanges a layer (dispatch with its tags, combine): one graph before the
    # first exchange, one between each pair, one after the last
    assert pieces == 2 * load_model_config(tmp_path).num_hidden_layers + 1, pieces

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (n,), generator=gen).tolist() for n in (5, 33, 17)]
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=30,
                                                                           ignore_eos=True)))
    checked, phase = 0, 0
    while eng.has_unfinished():
        batch = eng.schedule()
        bound = max(batch.num_tokens, 5)  # as if a peer had 5 sequences
        if all(it.end - it.start == 1 for it in batch.items):
            assert _graph_vs_eager(eng, ep, batch, bound) < tol
            checked += 1
            if checked == 1:  # the start-up capture is replayed at once (nothing stale)
                assert g.replays == 1 and g.captures == 1 and g._background is None
            if checked == 4:  # same shape: copied in place, no capture
                version, capture_s = ep.version, g.capture_s
                L, P = ep.placement.phy2log.shape
                perm = torch.stack([torch.randperm(P, generator=gen) for _ in range(L)])
                commit_placement(ep, Placement(ep.placement.phy2log.gather(1, perm),
                                               ep.placement.num_logical_experts,
                                               ep.placement.slots_per_rank,
                                               ep.placement.active_ranks), None, load_fn)
                assert ep.version == version and g.capture_s == capture_s
                phase = 1
            elif checked == 8:  # more slots per rank: captured again, in the background
                cfg = load_model_config(tmp_path)
                commit_placement(ep, initial_placement(cfg.num_hidden_layers, cfg.num_experts,
                                                       4, 1, 1), None, load_fn)
                assert ep.version != version and all(g.stale(b) for b in g.buckets)
                phase, replays, captures = 2, g.replays, g.captures
            elif checked == 9:  # the first step after it ran eagerly, a capture runs
                assert g.replays == replays and g._background is not None
                assert g.wait_capture(120) and g.captures == captures + 1
                assert not any(g.stale(b) for b in g.buckets)
                phase = 3
        with agreed_max_tokens(ep, bound):
            eng.commit(batch, eng.execute(batch))
    assert checked >= 20 and phase == 3
    assert g.replays > replays  # replaying again, and equal to eager (checked above)
    # an idle rank of an EP step: no sequences, the bucket of the agreed bound
    assert _graph_vs_eager(eng, ep, eng.schedule(), 3) == 0.0
