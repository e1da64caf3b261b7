"""Decode steps counted as graph replays or eager steps, from the model runner to
``/metrics`` and to the share per window that bench/failover.py reports."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
import torch

from bench import _decode_share
from elasticep import wire
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.frontend.metrics import FrontendMetrics
from elasticep.frontend_link import RankStats
from elasticep.frontend_link.channels import _OUTPUTS
from elasticep_testkit.harness.serve_process import parse_rank_metric
from elasticep_testkit.paths import DEMO_MODEL
from tests._loop_fakes import fake_loop


def test_a_cpu_runner_counts_every_decode_step_as_eager_and_no_prefill():
    eng = LLMEngine.from_pretrained(DEMO_MODEL, dtype=torch.float32, progress=False)
    r = eng.runner
    assert (r.decode_replays, r.decode_eager, r.graph_captures) == (0, 0, None)
    decode = prefill = 0
    prompts = [[11, 12, 13, 14, 15], [21, 22, 23]]
    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(f"r{i}", tuple(p),
                                        SamplingParams(max_tokens=6, ignore_eos=True)))
    while eng.has_unfinished():
        batch = eng.schedule()
        if batch.items and all(it.end - it.start == 1 and it.samples for it in batch.items):
            decode += 1
        else:
            prefill += 1
        eng.commit(batch, eng.execute(batch))
    # one prefill step of both prompts, then 5 decode steps (6 tokens, the first from
    # the prefill)
    assert (prefill, decode) == (1, 5)
    assert (r.decode_replays, r.decode_eager) == (0, 5)
    assert eng.generate([[31, 32]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert r.decode_eager == 5 + 2


def test_decode_counts_become_metrics_series_for_ranks_with_and_without_graphs():
    m = FrontendMetrics()
    m.rank_stats(2, steps=40, captures=1, replays=38, decode_replays=35, decode_eager=1,
                 prefill_replays=2)
    m.rank_stats(3, steps=12, captures=-1, replays=-1, decode_replays=0, decode_eager=10)
    text = m.render()[0].decode()
    assert parse_rank_metric(text, "elasticep_decode_replays") == {2: 35.0, 3: 0.0}
    assert parse_rank_metric(text, "elasticep_prefill_replays") == {2: 2.0, 3: 0.0}
    assert parse_rank_metric(text, "elasticep_decode_eager") == {2: 1.0, 3: 10.0}
    assert parse_rank_metric(text, "elasticep_cuda_graph_replays") == {2: 38.0}


def test_rank_stats_carry_the_decode_counts_on_the_wire():
    msg = RankStats(1, 3, 10, 1, 9, decode_replays=8, decode_eager=1, prefill_replays=4)
    back = wire.decode_json(wire.encode_json(msg), _OUTPUTS)
    assert back == msg and (back.decode_replays, back.decode_eager) == (8, 1)
    assert back.prefill_replays == 4
    assert RankStats(1, 3, 10, 1, 9).decode_eager == 0  # an older sender's message


def test_a_ranks_stats_carry_its_runners_prefill_replays_to_the_metric(monkeypatch):
    loop, engine, _ = fake_loop(monkeypatch, 0, [[1]], 0)
    engine.runner.prefill_replays, engine.runner.decode_replays = 6, 9
    engine.ep.placement.experts_held = lambda rank: 3
    loop._send_stats()
    assert loop.channel.stats[3:] == (9, 0, 6)
    m = FrontendMetrics()
    steps, captures, replays, decode, eager, prefill = loop.channel.stats
    m.rank_stats(0, steps, captures, replays, decode, eager, prefill)
    assert parse_rank_metric(m.render()[0].decode(), "elasticep_prefill_replays") == {0: 6.0}


def _line(t_wall: float, rank: int, steps: int, dt: float, replays: int, eager: int,
          tail: str = "graph captures: 1 since start (+0)") -> str:
    ts = datetime.fromtimestamp(t_wall).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return (f"{ts} rank={rank} epoch=1 elasticep.engine.step_rate: INFO rank {rank} epoch 1: "
            f"{steps} steps in {dt:.1f} s (10.00 ms/step), 700.0 generated tokens/s, 7.0 "
            f"tokens/step; decode CUDA graph replays: {replays} of {replays + eager} decode "
            f"steps ({eager} eager); {tail}\n")


def test_step_rate_lines_are_counted_in_the_window_of_their_midpoint(tmp_path):
    base = 1_800_000_000.0  # wall seconds of the first line
    offset = base - 100.0  # wall - monotonic: the bench's t = 100 is the first line
    windows = {"healthy": (97.0, 101.0), "degraded": (101.0, 104.0), "after": (110.0, 120.0)}
    (tmp_path / "rank0.log").write_text(
        "unrelated line\n"
        + _line(base, 0, 100, 1.0, 95, 3)        # mid 99.5: healthy
        + _line(base + 1.4, 0, 50, 1.0, 40, 10)  # mid 100.9: healthy
        + _line(base + 2.0, 0, 60, 1.0, 59, 1))  # mid 101.5: degraded
    (tmp_path / "rank1.log").write_text(
        _line(base + 0.9, 1, 99, 1.0, 90, 0, "no CUDA graphs")  # mid 100.4: healthy
        + _line(base + 9.0, 1, 10, 1.0, 10, 0))  # mid 108.5: in no window
    lines = _decode_share.read_lines(tmp_path)
    assert [(ln.rank, ln.replays) for ln in lines] == [(0, 95), (1, 90), (0, 40), (0, 59),
                                                       (1, 10)]
    out = _decode_share.summarize(lines, windows, offset)
    assert (out["decode_replays_healthy"], out["decode_eager_healthy"]) == (225, 13)
    assert out["decode_replay_share_healthy"] == round(225 / 238, 4)
    assert (out["decode_replays_degraded"], out["decode_eager_degraded"]) == (59, 1)
    assert out["decode_replay_share_after"] is None  # a window with no decode step
    assert out["decode_steps_by_rank"]["healthy"] == {0: [135, 13], 1: [90, 0]}


def test_a_step_rate_line_whose_counts_disagree_is_refused():
    bad = _line(time.time(), 0, 10, 1.0, 5, 2).replace("of 7 decode", "of 8 decode")
    with pytest.raises(ValueError, match="5 \\+ 2 != 8"):
        _decode_share.parse_line(bad)
    assert _decode_share.parse_line("12:00 something else") is None
