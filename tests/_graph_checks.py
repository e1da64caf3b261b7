"""Shared check of the GPU graph tests (not a test module): decode through the captured
graphs against the eager forward, step by step."""

from __future__ import annotations

import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams


def graph_steps_match_eager(eng: LLMEngine, prompts: list[list[int]], max_tokens: int,
                            tol: float = 2e-2) -> int:
    """Generate greedily; at every decode step compare the logits of the graph replay with
    the eager forward of the same batch (relative max error below ``tol``: the same
    kernels, but a batch padded to its bucket may take other GEMM tilings, bf16 noise).

    Returns:
        the number of decode steps compared.
    """
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(f"r{i}", tuple(p), params))
    steps = 0
    while eng.has_unfinished():
        batch = eng.schedule()
        if all(it.end - it.start == 1 for it in batch.items):
            graph_logits = eng.runner.forward(batch).clone()
            graphs, eng.runner.graphs = eng.runner.graphs, None
            eager_logits = eng.runner.forward(batch)
            eng.runner.graphs = graphs
            steps += 1
            err = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
            assert err < tol, (steps, float(err))
        eng.commit(batch, eng.execute(batch))
    return steps


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn in [10, 8000) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 8000, (n,), generator=g).tolist() for n in lengths]
