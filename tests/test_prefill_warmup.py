"""The prefill warm-up (engine/prefill_warmup.py) on CPU: its bucket arithmetic, the
shapes it runs (a recording stand-in for the engine's execute), the rank-side step
context, and one real run through the demo model that leaves generation unchanged. The
GPU test (no Triton compile after it) is test_prefill_warmup_gpu.py."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from elasticep.elastic.rank_model import warmup_step_context
from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.prefill_warmup import (
    MIXED_DECODES,
    SHORT_PROMPT,
    compositions,
    count_triton_compiles,
    engine_plan,
    run_warmup,
    step_budget,
    token_buckets,
    warm_up_prefill,
    warmup_plan,
)
from elasticep.engine.request import SamplingParams
from elasticep.models.layers import FLASH_PREFILL_MIN_SEQ_TOKENS
from elasticep_testkit.paths import DEMO_MODEL


def test_token_buckets_are_powers_of_two_then_the_budget():
    assert token_buckets(1) == [1]
    assert token_buckets(8) == [1, 2, 4, 8]
    assert token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    b = token_buckets(8192)
    assert b == [2**i for i in range(14)] and len(b) == 14
    with pytest.raises(ValueError, match="budget"):
        token_buckets(0)


def test_compositions_cover_flash_paged_short_and_mixed():
    by_kind = {s.kind: s for s in compositions(2048)}
    assert set(by_kind) == {"one", "two_long", "short", "mixed"}
    assert all(s.num_tokens == 2048 for s in by_kind.values())
    assert by_kind["one"].new == (2048,) and by_kind["one"].cached == (0,)
    assert by_kind["two_long"].new == (1024, 1024)  # both take SDPA's flash kernel
    assert by_kind["short"].new == (SHORT_PROMPT,) * 16 and set(by_kind["short"].cached) == {0}
    mixed = by_kind["mixed"]
    chunk = 2048 - MIXED_DECODES
    assert mixed.new == (chunk,) + (1,) * MIXED_DECODES
    assert mixed.cached == (chunk,) + (SHORT_PROMPT,) * MIXED_DECODES
    # the long prompts below the flash threshold, the short ones with a remainder
    kinds = {s.kind: s for s in compositions(300)}
    assert set(kinds) == {"one", "short", "mixed"}
    assert kinds["short"].new == (128, 128, 44)
    assert [s.kind for s in compositions(16)] == ["one"]
    assert [s.kind for s in compositions(1)] == ["one"]
    assert FLASH_PREFILL_MIN_SEQ_TOKENS <= 2048 // 2


def test_plan_covers_every_bucket_and_respects_the_cache():
    plan = warmup_plan(8192, kv_tokens=10**6)
    counts = sorted({s.num_tokens for s in plan})
    assert counts == token_buckets(8192)
    assert all(any(s.kind == "one" and s.num_tokens == n for s in plan) for n in counts)
    assert len(plan) <= 4 * len(counts)  # bounded: a few compositions per bucket
    small = warmup_plan(8192, kv_tokens=4096)
    assert small and all(s.kv_tokens <= 4096 for s in small)
    assert max(s.num_tokens for s in small) == 4096  # 'one' of 4096 fits, 'mixed' does not


def _fake_engine(num_blocks: int = 64, block_size: int = 16, chunk: int | None = 256,
                 max_batch_tokens: int = 4096, fail_at: int | None = None):
    seen = []

    def execute(batch):
        seen.append(batch)
        assert not eng.runner.replay_enabled  # warm-up steps run eagerly, never a graph
        if fail_at is not None and len(seen) == fail_at:
            raise RuntimeError("boom")
        for it in batch.items:  # every token of the sequence has a cache slot
            assert len(it.seq.block_table) * block_size >= it.end
        return []

    eng = SimpleNamespace(
        blocks=BlockManager(num_blocks, block_size),
        model=SimpleNamespace(config=SimpleNamespace(vocab_size=1000),
                              device=torch.device("cpu")),
        config=EngineConfig(max_total_tokens=num_blocks * block_size, block_size=block_size,
                            chunked_prefill_size=chunk, max_batch_tokens=max_batch_tokens),
        max_seq_len=num_blocks * block_size, execute=execute,
        runner=SimpleNamespace(replay_enabled=True))
    return eng, seen


def test_run_warmup_executes_each_step_and_gives_the_blocks_back():
    eng, seen = _fake_engine()
    plan = engine_plan(eng)
    entered = []

    @contextmanager
    def around(n):
        entered.append(n)
        yield

    report = run_warmup(eng, plan, around)
    assert report.steps == len(plan) == len(seen) and entered == [s.num_tokens for s in plan]
    assert report.token_counts == token_buckets(256)
    for step, batch in zip(plan, seen, strict=True):
        assert batch.num_tokens == step.num_tokens
        assert [(it.start, it.end) for it in batch.items] == [
            (c, c + n) for n, c in zip(step.new, step.cached, strict=True)]
        assert all(0 <= t < 1000 for it in batch.items for t in it.seq.prompt_token_ids)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.runner.replay_enabled  # graphs replay again after the warm-up
    # a failing step still gives its blocks back, and graphs their replays
    eng, _ = _fake_engine(fail_at=3)
    with pytest.raises(RuntimeError, match="boom"):
        run_warmup(eng, engine_plan(eng))
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.runner.replay_enabled


def test_step_budget_follows_the_scheduler():
    assert step_budget(_fake_engine(1024, chunk=8192, max_batch_tokens=4096)[0]) == 4096
    assert step_budget(_fake_engine(1024, chunk=512, max_batch_tokens=4096)[0]) == 512
    assert step_budget(_fake_engine(1024, chunk=None, max_batch_tokens=4096)[0]) == 4096
    # a prompt is shorter than the longest sequence
    assert step_budget(_fake_engine(64, chunk=None, max_batch_tokens=10**5)[0]) == 64 * 16 - 1


def test_warm_up_prefill_is_skipped_on_cpu_and_when_asked():
    eng, seen = _fake_engine()
    assert warm_up_prefill(eng) is None and warm_up_prefill(eng, skip=True) is None
    assert seen == []


def test_warmup_step_context_sets_the_bound_keeps_exchanges_local_and_restores():
    calls = []

    @contextmanager
    def local_exchange():
        calls.append("in")
        yield
        calls.append("out")

    model = SimpleNamespace(executor="hooked")
    ep = SimpleNamespace(step_max_tokens=7, uses_step_bound=True, local_exchange=local_exchange)
    with warmup_step_context(model, ep)(64):
        assert model.executor is ep and ep.step_max_tokens == 64 and calls == ["in"]
    assert calls == ["in", "out"] and ep.step_max_tokens == 7 and model.executor == "hooked"
    # an executor with the defaults (the CPU one): no bound, nothing exchanged
    from elasticep.moe.executor import ExecutorDefaults
    plain = ExecutorDefaults()
    with warmup_step_context(model, plain)(32):
        assert model.executor is plain and plain.step_max_tokens is None
    assert model.executor == "hooked"


def test_cuda_executors_local_exchange_copies_and_bypasses_the_transport():
    from elasticep.eplb import ExpertLocationMetadata
    from elasticep.eplb.placement import initial_placement
    from elasticep.moe.cuda_executor import CudaEPMoEExecutor
    from elasticep.moe.exchange.ipc_exchange import IpcExchange
    placement = initial_placement(2, 4, 0, 1, 2)
    meta = ExpertLocationMetadata.from_placement(placement, 0, "cpu")
    S = placement.slots_per_rank
    w13 = [torch.zeros(S, 8, 4), torch.zeros(S, 8, 4)]
    w2 = [torch.zeros(S, 4, 4), torch.zeros(S, 4, 4)]
    ep = CudaEPMoEExecutor(meta, w13, w2, None)
    ep.transport = IpcExchange(0, 2, 16, 4, torch.float32, 2, "cpu")
    real = ep._exchange
    with ep.local_exchange():
        assert ep._local_only and ep._exchange is not real
        out, inp = torch.zeros(3), torch.arange(3.0)
        ep._exchange(out, inp)
        assert out.tolist() == [0.0, 1.0, 2.0]
    assert not ep._local_only and ep._exchange is real


def test_count_triton_compiles_restores_the_hook():
    triton = pytest.importorskip("triton")
    knobs = triton.knobs.runtime
    before = knobs.jit_cache_hook
    with count_triton_compiles() as c:
        assert c.count == 0 and knobs.jit_cache_hook is not before
    assert knobs.jit_cache_hook is before


@pytest.mark.timeout(120)
def test_real_warmup_through_the_demo_model_leaves_generation_unchanged():
    """The plan's batches go through ModelRunner.prepare and the model on CPU (what
    the GPU path runs, with other kernels); afterwards the cache is all free and greedy
    tokens equal those of an engine that never warmed."""
    cfg = EngineConfig(max_total_tokens=2048, chunked_prefill_size=32, max_num_seqs=16)
    eng = LLMEngine.from_pretrained(DEMO_MODEL, config=cfg, progress=False)
    plan = engine_plan(eng)
    assert {s.kind for s in plan} == {"one", "mixed"} and max(s.num_tokens for s in plan) == 32
    report = run_warmup(eng, plan)
    assert report.steps == len(plan) and eng.blocks.num_free_blocks == eng.blocks.num_blocks
    prompts = [[5, 6, 7, 8, 9] * 3, list(range(40, 80))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    fresh = LLMEngine.from_pretrained(DEMO_MODEL, config=cfg, progress=False)
    assert eng.generate(prompts, params) == fresh.generate(prompts, params)
