"""Chunked prefill: the scheduler splits long prompts over steps that running decodes
share, and the engine's tokens equal unchunked generation (demo model, greedy, fp32)."""

from __future__ import annotations

import pytest

from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.scheduler import ScheduledBatch, Scheduler
from elasticep.engine.sequence import Sequence
from elasticep_testkit.paths import DEMO_MODEL

pytestmark = pytest.mark.timeout(120)

P = SamplingParams(max_tokens=12, ignore_eos=True)
SHORT = [[100 + i + j for j in range(10 + 3 * i)] for i in range(4)]
LONG = [(7 * j) % 8000 + 5 for j in range(300)]  # 300 tokens: five chunks of 64


def _commit(batch: ScheduledBatch) -> None:
    """What LLMEngine.commit does to a sequence, with token 1 for every sampled one."""
    for it in batch.items:
        samples = it.samples
        it.seq.num_cached_tokens = it.end
        if samples:
            it.seq.output_token_ids.append(1)


@pytest.mark.parametrize("max_batch_tokens,chunks", [(64, [8, 8, 8, 6]), (6, [4] * 7 + [2])])
def test_long_prompt_interleaves_with_decodes(max_batch_tokens, chunks):
    """Every running decode advances each step; the long prompt takes at most the chunk
    size, less what the decodes leave of max_batch_tokens; only its last chunk samples."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_batch_tokens=max_batch_tokens,
                      chunked_prefill_size=8)
    decodes = [Sequence(f"d{i}", [1] * 3, [], P, i) for i in range(2)]
    for s in decodes:
        sched.add(s)
    _commit(sched.schedule())  # both prompts (6 tokens) fit the first step
    assert [len(s.output_token_ids) for s in decodes] == [1, 1]
    long = Sequence("long", [2] * 30, [], P, 2)
    sched.add(long)
    got = []
    while not long.output_token_ids:
        batch = sched.schedule()
        by_id = {it.seq.request_id: it for it in batch.items}
        for s in decodes:  # each decode: one token, sampled, every step
            it = by_id[s.request_id]
            assert (it.end - it.start, it.samples) == (1, True)
        it = by_id["long"]
        assert it.start == sum(got) and it.samples == (it.end == 30)
        got.append(it.end - it.start)
        assert batch.num_tokens <= max(max_batch_tokens, 2 + 1)
        assert len(long.block_table) == -(-it.end // 4)  # blocks only for what is computed
        _commit(batch)
    assert got == chunks
    assert [len(s.output_token_ids) for s in decodes] == [1 + len(chunks)] * 2


def test_partial_prefill_goes_first_then_admissions_share_the_chunk():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_batch_tokens=64,
                      chunked_prefill_size=8)
    long, short = Sequence("long", [2] * 13, [], P, 0), Sequence("short", [3] * 5, [], P, 1)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert [(it.seq.request_id, it.start, it.end) for it in batch.items] == [("long", 0, 8)]
    _commit(batch)
    batch = sched.schedule()  # long's last 5 tokens, then 3 of short's 5
    assert [(it.seq.request_id, it.start, it.end, it.samples) for it in batch.items] == [
        ("long", 8, 13, True), ("short", 0, 3, False)]
    _commit(batch)
    batch = sched.schedule()
    assert [(it.seq.request_id, it.start, it.end) for it in batch.items] == [
        ("long", 13, 14), ("short", 3, 5)]


def test_preempted_partial_prefill_frees_blocks_and_restarts():
    # 4 blocks of 4: the older decode's growth evicts the partly prefilled newest sequence
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=8, max_batch_tokens=64,
                      chunked_prefill_size=8)
    old, long = Sequence("old", [1] * 4, [], P, 0), Sequence("long", [2] * 12, [], P, 1)
    sched.add(old)
    _commit(sched.schedule())
    sched.add(long)
    batch = sched.schedule()
    assert [(it.seq.request_id, it.start, it.end) for it in batch.items] == [
        ("old", 4, 5), ("long", 0, 8)]
    _commit(batch)
    assert long.num_cached_tokens == 8 and sched.blocks.num_free_blocks == 0
    old.output_token_ids.extend([1] * 3)  # old has 9 tokens: its next decode needs a 3rd block
    old.num_cached_tokens = 8
    batch = sched.schedule()
    assert [(it.seq.request_id, it.start, it.end) for it in batch.items] == [("old", 8, 9)]
    assert sched.num_preemptions == 1 and list(sched.waiting) == [long]
    assert long.block_table == [] and long.num_cached_tokens == 0  # 1 block free: too few
    sched.finish(old, "stop")
    batch = sched.schedule()  # restarted from its first token
    assert [(it.seq.request_id, it.start, it.end) for it in batch.items] == [("long", 0, 8)]


def test_chunked_prefill_size_must_be_positive():
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        Scheduler(BlockManager(4, 4), 8, 64, chunked_prefill_size=-1)


@pytest.fixture(scope="module")
def reference():
    prompts = [SHORT[0], SHORT[1], LONG, SHORT[2], SHORT[3]]
    return prompts, LLMEngine.from_pretrained(DEMO_MODEL, progress=False).generate(prompts, P)


def _engine(**kw) -> LLMEngine:
    return LLMEngine.from_pretrained(DEMO_MODEL, config=EngineConfig(**kw), progress=False)


@pytest.mark.parametrize("chunk", [16, 64])
def test_tokens_equal_unchunked(reference, chunk):
    prompts, want = reference
    eng = _engine(chunked_prefill_size=chunk)
    assert eng.generate(prompts, P) == want
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_long_prompt_joining_running_decodes(reference):
    """The long prompt arrives while the short ones decode: they get a token every step
    while its chunks run, and every request's tokens equal unchunked generation."""
    prompts, want = reference
    eng = _engine(chunked_prefill_size=64)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    shorts = [i for i in range(len(prompts)) if prompts[i] is not LONG]
    for i in shorts:
        eng.add_request(GenerateRequest(str(i), tuple(prompts[i]), P))
    for o in eng.step():  # all four short prompts (58 tokens) in one chunk
        got[o.request_id].append(o.token_id)
    assert all(len(got[str(i)]) == 1 for i in shorts)
    long_id = str(prompts.index(LONG))
    eng.add_request(GenerateRequest(long_id, tuple(LONG), P))
    long_steps = 0
    while not got[long_id]:
        batch = eng.schedule()
        assert sum(it.end - it.start for it in batch.items if it.seq.request_id == long_id) <= 64
        outs = eng.commit(batch, eng.execute(batch))
        assert sorted(o.request_id for o in outs if o.request_id != long_id) == sorted(
            str(i) for i in shorts)  # no decode stalls behind the prompt
        for o in outs:
            got[o.request_id].append(o.token_id)
        long_steps += 1
    assert long_steps == -(-len(LONG) // 64)
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].append(o.token_id)
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_redo_of_a_chunk_step_is_identical(reference):
    prompts, want = reference
    eng = _engine(chunked_prefill_size=48)
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(str(i), tuple(p), P))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    partial_steps = 0
    while eng.has_unfinished():
        batch = eng.schedule()
        partial_steps += any(not it.samples for it in batch.items)
        first = eng.execute(batch)
        again = eng.execute(batch)  # a redo after a failed step: same tokens, same KV
        assert first == again and len(first) == sum(it.samples for it in batch.items)
        for o in eng.commit(batch, again):
            got[o.request_id].append(o.token_id)
    assert partial_steps >= 5
    assert [got[str(i)] for i in range(len(prompts))] == want


def test_small_cache_preempts_chunked_sequences_without_changing_tokens(reference):
    prompts, want = reference
    eng = _engine(max_total_tokens=384, block_size=8, chunked_prefill_size=64)
    assert eng.generate(prompts, P) == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_resumed_request_continues_through_chunks(reference):
    """After a failover a request comes back as prompt + generated tokens: its chunked
    recompute continues exactly where the unchunked run went."""
    prompts, want = reference
    i = prompts.index(LONG)
    eng = _engine(chunked_prefill_size=40)
    eng.add_request(GenerateRequest("r", tuple(LONG), P, output_token_ids=tuple(want[i][:5])))
    got = []
    while eng.has_unfinished():
        got += [o.token_id for o in eng.step()]
    assert got == want[i][5:]
