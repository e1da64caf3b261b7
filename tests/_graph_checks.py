"""Shared check of the GPU graph tests (not a test module): decode through the captured
graphs against the eager forward, step by step."""

from __future__ import annotations

import torch

from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep_testkit.ep import assert_equal_under_near_tie_rule


def graph_steps_match_eager(eng: LLMEngine, prompts: list[list[int]], max_tokens: int,
                            tol: float = 2e-2) -> int:
    """Generate greedily; at every step compare the logits of the runner's forward (a
    graph replay where the step fits a bucket: decode steps, and prefill or mixed steps
    as one row a token) with the eager forward of the same batch (relative max error
    below ``tol``: the same math, but a batch padded to its bucket may take other GEMM
    tilings and the decode attention kernel, bf16 noise).

    Returns:
        the number of decode steps compared.
    """
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(f"r{i}", tuple(p), params))
    steps, prefill, worst = 0, 0, 0.0
    while eng.has_unfinished():
        batch = eng.schedule()
        decode = all(it.end - it.start == 1 for it in batch.items)
        graph_logits = eng.runner.forward(batch).clone()
        graphs, eng.runner.graphs = eng.runner.graphs, None
        eager_logits = eng.runner.forward(batch)
        eng.runner.graphs = graphs
        steps, prefill = steps + decode, prefill + (not decode)
        if eager_logits.numel():
            err = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
            assert err < tol, (steps, prefill, float(err))
            worst = max(worst, float(err))
        eng.commit(batch, eng.execute(batch))
    # the observed error, in the log of a GPU run (-v -s): what tol could be tightened to
    print(f"graph vs eager: {steps} decode and {prefill} prefill steps "
          f"({eng.runner.prefill_replays} replayed as rows so far), worst relative max "
          f"error {worst:.2e}")
    return steps


# A bf16 greedy token may flip between two runs of other GEMM tilings only where the
# reference run's top-2 logits are this close, relative to the largest |logit| of that
# position: the step-by-step check's tolerance (graph_steps_match_eager's ``tol``).
NEAR_TIE_REL = 2e-2


def assert_greedy_tokens_match(got: list[list[int]], want: list[list[int]],
                               prompts: list[list[int]], ref: LLMEngine, what: str,
                               cap: int) -> list[str]:
    """Token-for-token equality of two greedy runs of ``prompts``, with a capped,
    reported near-tie excuse (:func:`elasticep_testkit.ep.assert_equal_under_near_tie_rule`).

    A prompt may differ only from a token where ``ref`` (the engine that gave ``want``)
    has its top-2 logits within :data:`NEAR_TIE_REL` of that position's largest |logit|
    (the rest of the sequence then diverges legitimately), and at most ``cap`` prompts
    may use the excuse (``cap=0``: every token equal). Each excuse is printed and warned.

    Returns:
        One line per excused prompt.
    """
    margins = []
    for p, g, w in zip(prompts, got, want, strict=True):
        if g == w:  # no margin needed: skip the forward
            margins.append([1.0] * len(w))
            continue
        logits = ref.prompt_logits(list(p) + w[:-1])[len(p) - 1:].float()  # predict w
        top2 = torch.topk(logits, 2, dim=-1).values
        margins.append(((top2[:, 0] - top2[:, 1]) / logits.abs().amax(-1)).tolist())
    return assert_equal_under_near_tie_rule(got, want, margins, what, NEAR_TIE_REL, cap)


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn in [10, 8000) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 8000, (n,), generator=g).tolist() for n in lengths]
