"""The admission policy (engine/admission.py) as a pure function, and the scheduler
following it: a request waits for no step while the budget has room, every decode runs
every step, and prefill never takes a step past its budget."""

from __future__ import annotations

import random

import pytest

from elasticep.engine.admission import StepBudget, plan_step, take_chunks
from elasticep.engine.kv_cache import BlockManager
from elasticep.engine.request import SamplingParams
from elasticep.engine.scheduler import Scheduler
from elasticep.engine.sequence import Sequence

pytestmark = pytest.mark.timeout(60)


def random_states(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        budget = StepBudget(rng.choice([16, 64, 256, 512]),
                            rng.choice([None, 8, 32, 128, 1024]))
        decodes = rng.randrange(0, 300)
        partial = ([rng.randrange(1, 400) for _ in range(rng.randrange(0, 4))]
                   if budget.chunked_prefill_size else [])
        waiting = [rng.randrange(1, 600) for _ in range(rng.randrange(0, 12))]
        yield budget, decodes, partial, waiting, rng.randrange(0, 16)


def test_decodes_all_run_and_prefill_keeps_the_step_within_its_budget():
    for budget, decodes, partial, waiting, free in random_states(3000):
        plan = plan_step(decodes, partial, waiting, free, budget)
        assert plan.decodes == decodes  # no decode is ever left out for a prefill
        assert plan.prefill <= budget.prefill_tokens(decodes) or (
            # an unchunked prompt above the budget, alone in an otherwise empty step
            budget.chunked_prefill_size is None and decodes == 0 and len(plan.admitted) == 1)
        if budget.chunked_prefill_size is not None:
            assert plan.prefill <= budget.chunked_prefill_size
            assert plan.num_tokens <= max(budget.max_num_batched_tokens, decodes)
        assert len(plan.admitted) <= max(0, free)
        assert all(n >= 1 for n in plan.partial + plan.admitted)


def test_no_request_waits_a_step_while_the_budget_allows():
    for budget, decodes, partial, waiting, free in random_states(3000, seed=1):
        plan = plan_step(decodes, partial, waiting, free, budget)
        room = budget.prefill_tokens(decodes) - sum(partial)
        # every arrival whose prompt fits what is left, in order, is admitted whole now
        fits = 0
        for need in waiting[:max(0, free)]:
            if need > room:
                break
            fits, room = fits + 1, room - need
        assert len(plan.admitted) >= fits
        assert list(plan.admitted[:fits]) == waiting[:fits]
        if budget.chunked_prefill_size is not None and room > 0 and fits < min(len(waiting), free):
            # chunked: the next one starts with what is left instead of waiting
            assert plan.admitted[fits] == room
        if sum(partial) <= budget.prefill_tokens(decodes):
            assert list(plan.partial) == partial  # every partial prompt goes on at once


def test_partial_prompts_go_first_then_arrivals_in_order():
    b = StepBudget(max_num_batched_tokens=100, chunked_prefill_size=64)
    plan = plan_step(10, [50, 30], [5, 5], 4, b)
    assert (plan.partial, plan.admitted) == ((50, 14), ())  # 64 prefill tokens: all partial
    plan = plan_step(10, [20], [30, 30, 30], 2, b)
    assert (plan.partial, plan.admitted) == ((20,), (30, 14))  # 2 free slots, 64 tokens
    assert plan.num_tokens == 74
    # decodes near the budget squeeze prefill, never the decodes
    plan = plan_step(95, [], [30], 1, b)
    assert (plan.decodes, plan.admitted, plan.num_tokens) == (95, (5,), 100)
    assert plan_step(120, [], [30], 1, b).admitted == ()  # decodes alone exceed it


def test_unchunked_admits_whole_prompts_and_a_long_one_alone():
    assert take_chunks([10, 20, 5], 30, chunked=False, step_empty=False) == [10, 20]
    assert take_chunks([50, 5], 30, chunked=False, step_empty=True) == [50]
    assert take_chunks([50, 5], 30, chunked=False, step_empty=False) == []
    assert take_chunks([50, 5], 30, chunked=True, step_empty=False) == [30]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        StepBudget(0)
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        StepBudget(64, 0)


def seqs(lengths: list[int], first: int = 0) -> list[Sequence]:
    return [Sequence(f"r{first + i}", list(range(1, n + 1)), [], SamplingParams(), first + i)
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("chunk", [None, 48])
def test_the_scheduler_with_ample_blocks_follows_the_plan_step_by_step(chunk):
    """A simulated load (arrivals every step, decodes finishing) through the real
    scheduler: each step's batch is plan_step's, and with room in the budget every
    arrival is in the very next step."""
    rng = random.Random(7)
    budget, max_seqs = 128, 16
    sched = Scheduler(BlockManager(4096, 16), max_seqs, budget, chunk)
    arrived = 0
    for _ in range(60):
        new = seqs([rng.randrange(4, 60) for _ in range(rng.randrange(0, 3))], arrived)
        arrived += len(new)
        for s in new:
            sched.add(s)
        decodes = [s for s in sched.running if s.num_new_tokens == 1]
        partial = [s.num_new_tokens for s in sorted(sched.running, key=lambda s: s.arrival)
                   if s.num_new_tokens > 1]
        waiting = [s.num_new_tokens for s in sched.waiting]
        plan = plan_step(len(decodes), partial, waiting, max_seqs - len(sched.running),
                         sched.budget)
        batch = sched.schedule()
        got_decodes = sum(1 for it in batch.items if it.end - it.start == 1
                          and it.seq.num_cached_tokens == it.start and it.seq in decodes)
        assert got_decodes == len(decodes)
        assert batch.num_tokens == plan.num_tokens
        if sum(waiting) <= sched.budget.prefill_tokens(len(decodes)) - sum(partial) \
                and len(waiting) <= max_seqs - len(sched.running) + len(plan.admitted):
            assert not sched.waiting  # nobody waits a step
        # commit: chunks advance, finished prompts sample one token, some requests end
        for it in batch.items:
            it.seq.num_cached_tokens = it.end
            if it.samples:
                it.seq.output_token_ids.append(1)
                if len(it.seq.output_token_ids) >= rng.randrange(3, 12):
                    sched.finish(it.seq, "length")


def test_max_num_batched_tokens_flag_sets_the_budget_and_bounds_the_exchange():
    from elasticep.config import DeploymentConfig
    from elasticep.engine import limits as L
    from elasticep.entrypoints.cli import build_parser
    from elasticep.entrypoints.deployment_args import deployment_config

    args = build_parser("serve").parse_args(
        ["serve", "--device", "cuda", "--max-num-batched-tokens", "2048",
         "--chunked-prefill-size", "1024", "--max-running-requests", "256",
         "--moe-a2a-backend", "all_to_all"])
    d = deployment_config(args)
    assert d.max_num_batched_tokens == 2048
    engine = L.rank_limits(d, 100_000).engine_config()
    assert (engine.max_batch_tokens, engine.chunked_prefill_size) == (2048, 1024)
    assert L.max_step_tokens(d) == 2048  # prefill never takes a step past the budget
    many = DeploymentConfig(model="m", device="cuda", max_num_batched_tokens=128,
                            max_running_requests=512)
    assert L.max_step_tokens(many) == 512  # decodes alone may exceed it
    # not given: as before the flag, the larger of 4096 and the chunk
    default = DeploymentConfig(model="m", device="cuda", chunked_prefill_size=16384)
    assert L.rank_limits(default, 100_000).engine_config().max_batch_tokens == 16384
    with pytest.raises(ValueError, match="--max-num-batched-tokens must be >= 1"):
        DeploymentConfig(model="m", max_num_batched_tokens=0)
