"""After the prefill warm-up no request compiles a Triton kernel (GPU only).

The rank's setup as the worker builds it (demo model shape, bf16 dummy weights, the CUDA
EP executor over a one-rank NCCL group, decode graphs, chunked prefill) with a context
long enough for the flash path; the warm-up runs with the worker's step context, then
prompts of compositions it never ran (odd lengths, many short ones, long ones, a prompt
longer than a chunk beside running decodes) are generated while Triton's compile hook
counts: zero, and the names of any that did compile are the failure message.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from test_cuda_graph_ep_gpu import nccl_world  # noqa: F401 - the one-rank NCCL group fixture

from elasticep.elastic.rank_model import attach_ep_executor, load_rank_weights, warmup_step_context
from elasticep.elastic.step_header import agreed_max_tokens
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.prefill_warmup import count_triton_compiles, engine_plan, warm_up_prefill
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.eplb.placement import initial_placement
from elasticep.models.config import load_model_config
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]

CHUNK = 2048
_ids = itertools.count()


def _rank_engine(tmp_path: Path):
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192  # whole prompts >= 1024 tokens take SDPA flash
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mcfg = load_model_config(tmp_path)
    placement = initial_placement(mcfg.num_hidden_layers, mcfg.num_experts, 0, 1, 1)
    model = load_rank_weights(tmp_path, placement, 0, torch.bfloat16, "cuda",
                              load_format="dummy")
    ep, _ = attach_ep_executor(model, placement, 0, None, "static")
    eng = LLMEngine(model, EngineConfig(max_total_tokens=32768, max_num_seqs=64,
                                        max_batch_tokens=CHUNK, chunked_prefill_size=CHUNK,
                                        forward_empty_batches=True, cuda_graph_max_bs=64))
    return eng, ep


def _serve(eng: LLMEngine, ep, prompts: list[list[int]], tokens: int = 3) -> None:
    for p in prompts:
        eng.add_request(GenerateRequest(f"q{next(_ids)}", tuple(p),
                                        SamplingParams(max_tokens=tokens, ignore_eos=True)))
    while eng.has_unfinished():
        batch = eng.schedule()
        with agreed_max_tokens(ep, batch.num_tokens):
            eng.commit(batch, eng.execute(batch))


def test_no_triton_compile_on_the_request_path_after_warmup(tmp_path, nccl_world):  # noqa: F811
    eng, ep = _rank_engine(tmp_path)
    plan = engine_plan(eng)
    report = warm_up_prefill(eng, warmup_step_context(eng.model, ep))
    assert report is not None and report.steps == len(plan)
    assert report.token_counts[-1] == CHUNK
    print(f"warm-up: {report.steps} steps in {report.seconds:.2f}s, "
          f"{report.triton_compiles} Triton compiles")
    g = torch.Generator().manual_seed(0)

    def rand(*lens: int) -> list[list[int]]:
        return [torch.randint(10, 8000, (n,), generator=g).tolist() for n in lens]

    with count_triton_compiles() as c:
        for lens in [(37,), (5,) * 23, (1500,), (700, 301, 999), (128,) * 16, (512,) * 4,
                     (333,) * 3, (1031, 1017), (17, 2000), (1,), (3, 1, 250)]:
            _serve(eng, ep, rand(*lens))
        # a prompt over two chunks while short ones decode: mixed steps
        for i, p in enumerate(rand(40, 30, 20)):
            eng.add_request(GenerateRequest(f"d{i}", tuple(p),
                                            SamplingParams(max_tokens=40, ignore_eos=True)))
        _serve(eng, ep, rand(3000))
    assert c.count == 0, c.names
