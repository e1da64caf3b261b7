"""The serving benchmark's requests through the in-process :class:`LLMEngine`: the
engine's own rate on the same work, with no HTTP, front-end or ranks in between.

Every request is available at the start; at most ``max_concurrency`` sequences are in
the engine at once, refilled as they finish (the served run's concurrency cap). Each
step's tokens are timestamped when ``step()`` returns them (it returns Python ints, so
the device work of the step is done), which gives TTFT, TPOT and ITL per request as a
client of the server would see them, without the transport.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams, TokenOutput
from elasticep_testkit.serving.datasets import BenchRequest
from elasticep_testkit.serving.metrics import RequestResult


class SteppedEngine(Protocol):
    """What :func:`run_engine` uses of :class:`LLMEngine`."""

    def add_request(self, req: GenerateRequest) -> None: ...

    def step(self) -> list[TokenOutput]: ...


def kv_tokens_for(requests: Sequence[BenchRequest], max_concurrency: int,
                  block_size: int = 16) -> int:
    """KV-cache tokens that hold the ``max_concurrency`` longest requests at once (each
    rounded up to whole blocks), so the baseline never waits for cache space."""
    lens = sorted((-(-(r.prompt_len + r.output_len) // block_size) * block_size
                   for r in requests), reverse=True)
    return max(sum(lens[:max_concurrency]), block_size)


def load_engine(model: str | Path, *, device: str, dtype: str, load_format: str,
                max_concurrency: int, max_total_tokens: int,
                enable_cuda_graph: bool = True, chunked_prefill_size: int | None = None,
                max_batch_tokens: int | None = None) -> LLMEngine:
    """The engine the baseline runs: every expert local, ``max_concurrency`` sequences
    per step, ``max_total_tokens`` of KV cache, and the step budget given (a served
    rank's, for a like-for-like comparison; None: :class:`EngineConfig`'s defaults)."""
    budget = {} if max_batch_tokens is None else {"max_batch_tokens": max_batch_tokens}
    config = EngineConfig(max_total_tokens=max_total_tokens, max_num_seqs=max_concurrency,
                          enable_cuda_graph=enable_cuda_graph,
                          chunked_prefill_size=chunked_prefill_size, **budget)
    return LLMEngine.from_pretrained(model, dtype=getattr(torch, dtype), device=device,
                                     config=config, progress=False, load_format=load_format)


def run_engine(engine: SteppedEngine, requests: Sequence[BenchRequest],
               max_concurrency: int, ignore_eos: bool,
               clock: Callable[[], float] = time.perf_counter,
               ) -> tuple[list[RequestResult], float]:
    """Run every request greedily through ``engine``, ``max_concurrency`` at a time.

    A request starts when it is added; its tokens arrive when the ``step()`` that made
    them returns, and its E2E ends at the step that finished it (no stream follows).

    Args:
        engine: an :class:`LLMEngine` (or anything with its ``add_request``/``step``).
        requests: what to run, in order of admission.
        max_concurrency: most requests in the engine at once.
        ignore_eos: ask for exactly ``output_len`` tokens.
        clock: seconds, monotonic (``time.perf_counter``).

    Returns:
        (results in request order, seconds from the first admission to the last token).

    Raises:
        ValueError: the engine refuses a request (it does not fit its limits).
    """
    results = [RequestResult(prompt_len=r.prompt_len) for r in requests]
    last: dict[str, float] = {}
    pending = list(range(len(requests)))[::-1]  # pop() takes them in order
    running: set[str] = set()
    t0 = clock()
    while pending or running:
        while pending and len(running) < max_concurrency:
            i = pending.pop()
            rid = f"bench-{i}"
            req = requests[i]
            engine.add_request(GenerateRequest(rid, req.prompt_ids, SamplingParams(
                max_tokens=req.output_len, temperature=0.0, ignore_eos=ignore_eos)))
            results[i].start = last[rid] = clock()
            running.add(rid)
        outputs = engine.step()
        now = clock()
        for out in outputs:
            res = results[int(out.request_id.rsplit("-", 1)[1])]
            if res.ttft is None:
                res.ttft = now - res.start
            else:
                res.itl.append(now - last[out.request_id])
            last[out.request_id] = now
            res.output_tokens += 1
            if out.finish_reason is not None:
                res.e2e = now - res.start
                running.discard(out.request_id)
    end = max((r.start + r.e2e for r in results), default=t0)
    return results, max(end - t0, 1e-9)
