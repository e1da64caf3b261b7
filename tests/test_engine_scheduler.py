"""Scheduler and KV cache: a full cache queues (and preempts) without failing requests,
continuous batching, abort, and redoing a step before commit."""

from __future__ import annotations

import pytest

from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.scheduler import Scheduler
from elasticep.engine.sequence import Sequence
from elasticep.moe.executor import ExecutorDefaults
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(60)

PROMPTS = [[100 + i + j for j in range(10 + 3 * i)] for i in range(6)]
P = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    eng = LLMEngine.from_pretrained(DEMO_MODEL, progress=False)
    return eng.generate(PROMPTS, P)


def test_block_manager_accounting():
    bm = BlockManager(num_blocks=4, block_size=4)
    table: list[int] = []
    bm.grow(table, 5)
    assert len(table) == 2 and bm.num_free_blocks == 2
    assert bm.can_grow(table, 16) and not bm.can_grow(table, 17)
    with pytest.raises(RuntimeError):
        bm.grow(table, 17)
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 4


def test_scheduler_waits_when_full_and_preempts_newest():
    sched = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_seqs=8, max_batch_tokens=64)
    seqs = [Sequence(f"s{i}", [1] * 7, [], P, i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [it.seq.request_id for it in batch.items] == ["s0", "s1"]  # s2 waits, no error
    for it in batch.items:  # commit one token each: 8 tokens = 2 full blocks
        it.seq.num_cached_tokens = it.end
        it.seq.output_token_ids.append(1)
        it.seq.output_token_ids.append(1)  # pretend a second token, needs a 3rd block
    batch = sched.schedule()
    assert [it.seq.request_id for it in batch.items] == ["s0"]
    assert sched.num_preemptions == 1 and [s.request_id for s in sched.waiting] == ["s1", "s2"]
    assert sched.waiting[0].num_cached_tokens == 0 and sched.waiting[0].block_table == []


def test_full_kv_cache_queues_requests(reference):
    # 64 tokens of KV for 6 requests of up to 37 tokens each: most must wait or be preempted
    eng = LLMEngine.from_pretrained(
        DEMO_MODEL, config=EngineConfig(max_total_tokens=64, block_size=8), progress=False
    )
    outs = eng.generate(PROMPTS, P)
    assert outs == reference
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_continuous_batching_join_leave_and_abort(reference):
    eng = LLMEngine.from_pretrained(DEMO_MODEL, progress=False)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    eng.add_request(GenerateRequest("a", tuple(PROMPTS[0]), P))
    eng.add_request(GenerateRequest("c", tuple(PROMPTS[2]), P))
    for step in range(40):
        if step == 3:
            eng.add_request(GenerateRequest("b", tuple(PROMPTS[1]), P))  # joins mid-flight
        if step == 5:
            assert eng.abort("c")
        outs = eng.step()
        if step == 4:
            assert {o.request_id for o in outs} == {"a", "b", "c"}
        for o in outs:
            got[o.request_id].append(o.token_id)
        if not eng.has_unfinished():
            break
    assert got["a"] == reference[0] and got["b"] == reference[1]
    assert got["c"] == reference[2][:5]  # steps 0-4 ran before the abort
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_redo_step_before_commit_is_identical(reference):
    eng = LLMEngine.from_pretrained(DEMO_MODEL, progress=False)
    for i, p in enumerate(PROMPTS[:3]):
        eng.add_request(GenerateRequest(f"r{i}", tuple(p), P))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while eng.has_unfinished():
        batch = eng.schedule()
        first = eng.execute(batch)
        again = eng.execute(batch)  # a redo after a failed step: same tokens, same KV
        assert first == again
        for o in eng.commit(batch, again):
            got[o.request_id].append(o.token_id)
    assert [got[f"r{i}"] for i in range(3)] == reference[:3]


def test_empty_batch_still_runs_every_moe_layer():
    eng = LLMEngine.from_pretrained(DEMO_MODEL, config=EngineConfig(forward_empty_batches=True), progress=False)
    calls = []
    inner = eng.model.executor

    class Spy(ExecutorDefaults):  # an executor has the protocol's capability attributes
        def __call__(self, layer, h, ids, w):
            calls.append((layer, h.shape[0]))
            return inner(layer, h, ids, w)

    eng.model.executor = Spy()
    assert eng.step() == [] and not eng.has_unfinished()
    assert calls == [(i, 0) for i in eng.model.config.moe_layer_ids]
