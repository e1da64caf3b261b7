"""bench/serving.py: its pure parts (datasets, arrivals, metrics, the stub engine's
pacing), and two short end-to-end runs on this machine: against `elasticep serve` of
the demo model, and against the real front-end over stub ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep_testkit.serving.client import arrival_gaps
from elasticep_testkit.serving.datasets import draw_lengths, gsm8k_requests, random_requests
from elasticep_testkit.serving.metrics import RequestResult, summarize
from elasticep_testkit.serving.stub_engine import StubEngine, report

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "tiny-qwen3-moe"
RUN_TIMEOUT_S = 100  # one bench run: serve start-up on 2 cores, then a few seconds of load


def run_bench(*args: str) -> tuple[int, dict | None, str]:
    """``python -m bench.serving ARGS`` from the repository root: (exit code, the JSON
    line or None, stderr)."""
    p = subprocess.run([sys.executable, "-m", "bench.serving", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]

    def strict(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return (p.returncode, json.loads(lines[-1], parse_constant=strict) if lines else None,
            p.stderr)


# ---- pure parts ------------------------------------------------------------------------
def test_lengths_are_uniform_between_the_ratio_and_the_maximum():
    rng = np.random.default_rng(0)
    lens = draw_lengths(rng, 2000, 100, 0.5)
    assert min(lens) == 50 and max(lens) == 100
    assert 70 < np.mean(lens) < 80
    assert draw_lengths(rng, 5, 7, 1.0) == [7] * 5
    assert min(draw_lengths(rng, 500, 3, 0.0)) == 1  # never an empty prompt
    with pytest.raises(ValueError, match="range-ratio"):
        draw_lengths(rng, 1, 10, 1.5)


def test_random_prompts_are_ids_without_a_tokenizer_and_text_of_that_length_with_one():
    ids_only = random_requests(6, 40, 9, 1.0, seed=3, tokenizer=None, vocab_size=100)
    assert [len(r.prompt) for r in ids_only] == [40] * 6
    assert all(isinstance(r.prompt, list) and all(0 <= t < 100 for t in r.prompt)
               for r in ids_only)
    assert [r.output_len for r in ids_only] == [9] * 6
    assert random_requests(6, 40, 9, 1.0, 3, None, 100) == ids_only  # seeded
    tok = AutoTokenizer.from_pretrained(DEMO)
    texts = random_requests(6, 40, 9, 1.0, seed=3, tokenizer=tok, vocab_size=len(tok))
    assert all(isinstance(r.prompt, str) for r in texts)
    for r in texts:  # what the server will count
        assert r.prompt_ids == tuple(tok.encode(r.prompt)) and r.prompt_len == len(r.prompt_ids)
        assert abs(r.prompt_len - 40) <= 2, r.prompt_len
    gsm = gsm8k_requests(70, 16, 1.0, 0, tok)  # the 64-item sample, cycled
    assert gsm[64].prompt == gsm[0].prompt and gsm[0].prompt.startswith("Question: ")
    with pytest.raises(ValueError, match="needs a model with a tokenizer"):
        gsm8k_requests(2, 16, 1.0, 0, None)


def test_poisson_gaps_have_the_requested_mean_and_inf_sends_at_once():
    gaps = arrival_gaps(4000, 20.0, seed=1)
    assert 0.045 < np.mean(gaps) < 0.055
    assert arrival_gaps(3, float("inf"), 1) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(3, 0.0, 1)


def test_summary_counts_failed_requests_apart_and_computes_latencies_in_ms():
    ok = RequestResult(prompt_len=10, output_tokens=3, start=0.0, ttft=0.1,
                       itl=[0.02, 0.04], e2e=0.16)
    ok2 = RequestResult(prompt_len=20, output_tokens=1, start=0.0, ttft=0.3, e2e=0.3)
    bad = RequestResult(prompt_len=99, output_tokens=0, error="HTTP 500")
    s = summarize([ok, ok2, bad], duration_s=0.5)
    assert (s["completed"], s["errors"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (30, 4)
    assert s["output_throughput"] == 8.0 and s["request_throughput"] == 4.0
    assert s["mean_ttft_ms"] == 200.0 and s["median_ttft_ms"] == 200.0
    # TPOT only for requests with 2+ tokens: (0.16 - 0.1) / 2
    assert s["mean_tpot_ms"] == 30.0 and s["p99_tpot_ms"] == 30.0
    assert s["mean_itl_ms"] == 30.0 and s["median_itl_ms"] == 30.0
    assert s["concurrency"] == round((0.16 + 0.3) / 0.5, 2)
    with pytest.raises(ValueError):
        summarize([ok], 0.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_stub_engine_paces_steps_and_emits_one_token_per_running_request():
    clock = FakeClock()
    eng = StubEngine(50.0, clock=clock, sleep=clock.sleep)
    eng.add_request(GenerateRequest("a", (7, 8), SamplingParams(max_tokens=3)))
    eng.add_request(GenerateRequest("b", (9,), SamplingParams(max_tokens=1)))
    first = eng.step()  # from idle: at once
    assert [(o.request_id, o.index, o.token_id, o.finish_reason) for o in first] == [
        ("a", 0, 7, None), ("b", 0, 9, "length")]
    second = eng.step()
    assert [(o.request_id, o.index, o.token_id) for o in second] == [("a", 1, 8)]
    assert clock.slept == [pytest.approx(0.02)]  # waited for the next tick
    clock.t += 0.1  # the loop was held up for five periods: late, no burst
    third = eng.step()
    assert [(o.index, o.token_id, o.finish_reason) for o in third] == [(2, 7, "length")]
    assert (eng.tokens, eng.steps, eng.late_steps) == (4, 3, 1)
    assert not eng.has_unfinished()
    assert eng.abort("a") is False
    assert report({"tokens": 0, "steps": 0, "late_steps": 0, "busy_s": 0.0},
                  {"tokens": 100, "steps": 10, "late_steps": 1, "busy_s": 0.5},
                  steps_per_s=20.0, max_concurrency=10, served_tokens=100,
                  duration_s=0.5) == {
        "steps_per_s": 20.0, "emitted_tokens": 100, "steps": 10, "late_steps": 1,
        "emitted_tok_s": 200.0, "nominal_tok_s": 200.0, "served_over_nominal": 1.0}
    with pytest.raises(ValueError):
        StubEngine(0.0)


# ---- end to end ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 20)
def test_bench_against_serve_of_the_demo_model_gives_one_sane_json_line(tmp_path):
    out = tmp_path / "runs.jsonl"
    code, line, err = run_bench(
        "--launch", "--num-prompts", "6", "--max-concurrency", "3", "--random-input-len",
        "16", "--random-output-len", "8", "--random-range-ratio", "1", "--ignore-eos",
        "--output-file", str(out), "--engine-baseline")
    assert code == 0, err[-2000:]
    assert (line["completed"], line["errors"]) == (6, 0)
    assert line["total_output_tokens"] == 6 * 8
    assert abs(line["total_input_tokens"] - 6 * 16) <= 12  # text re-encoded by the server
    assert line["max_concurrency"] == 3 and 0 < line["concurrency"] <= 3
    assert line["request_rate"] == "inf"  # strict JSON: no Infinity
    for key in ("ttft", "tpot", "itl", "e2e_latency"):
        assert 0 < line[f"median_{key}_ms"] <= line[f"p99_{key}_ms"]
    assert line["median_e2e_latency_ms"] >= line["median_ttft_ms"]
    # the first request, sent alone before the warm-up, against the measured median
    assert line["ttft_first_ms"] > 0
    assert line["ttft_first_over_median"] == pytest.approx(
        line["ttft_first_ms"] / line["median_ttft_ms"], abs=0.002)
    assert line["output_throughput"] == pytest.approx(48 / line["duration_s"], rel=0.01)
    assert line["commit"] and line["model"] == "tiny-qwen3-moe"
    assert json.loads(out.read_text().splitlines()[-1]) == line
    # the same requests through the in-process engine, 3 at a time
    engine = line["engine"]
    assert (engine["completed"], engine["errors"]) == (6, 0)
    assert engine["total_output_tokens"] == 6 * 8
    assert engine["total_input_tokens"] == line["total_input_tokens"]  # the same prompts
    assert 0 < engine["concurrency"] <= 3
    ratios = line["served_over_engine"]
    assert ratios["output_throughput"] == pytest.approx(
        line["output_throughput"] / engine["output_throughput"], abs=0.002)
    assert ratios["median_tpot_ms"] > 0


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 20)
def test_stub_engine_mode_streams_every_token_at_the_stubs_rate():
    steps_per_s, n, out_len = 40.0, 8, 20
    code, line, err = run_bench(
        "--launch", "--stub-engine-steps-per-s", str(steps_per_s), "--num-prompts", str(n),
        "--max-concurrency", str(n), "--random-input-len", "16", "--random-output-len",
        str(out_len), "--random-range-ratio", "1", "--ignore-eos",
        "--serve-arg=--ep-size", "--serve-arg=2")
    assert code == 0, err[-2000:]
    assert (line["completed"], line["errors"]) == (n, 0)
    assert line["total_output_tokens"] == n * out_len
    stub = line["stub"]
    assert stub["emitted_tokens"] == n * out_len  # everything the ranks sent arrived
    assert stub["nominal_tok_s"] == steps_per_s * n
    # loose bounds: a shared 2-core machine; one token per request per 25 ms step
    assert 0.5 * 25 < line["median_tpot_ms"] < 3 * 25, line["median_tpot_ms"]
    assert 0.3 < stub["served_over_nominal"] <= 1.05, stub
    assert 0.5 * steps_per_s * n < stub["emitted_tok_s"] <= 1.2 * steps_per_s * n, stub
    # the first-token trace, in steps: every request's first token came from the rank's
    # next step after it took the request (the stub admits at once), and the
    # front-end's own stages (HTTP, tokenizer, routing, delivery, SSE write) added less
    # than one step to the median request's first token
    trace = line["first_token_trace"]
    assert trace["requests"] == n, trace
    assert trace["rank_steps"] == {"p50": 1, "p99": 1, "max": 1}, trace
    assert set(trace["stages_ms"]) == {
        "http_to_tokenized", "tokenized_to_routed", "routed_to_rank", "rank_to_scheduled",
        "scheduled_to_committed", "committed_to_published", "published_to_frontend",
        "frontend_to_delivered", "delivered_to_written"}
    assert all(v is not None and 0 <= v["p50"] <= v["p99"]
               for v in trace["stages_ms"].values()), trace
    step_ms = 1000 / steps_per_s
    assert trace["frontend_ms"]["p50"] / step_ms <= 1, trace


def test_bad_flags_are_one_line_and_exit_2(capsys):
    """In this process (before: one interpreter each, 15 s of the suite): argparse's
    ``error`` exits 2, a bad --model makes ``main`` return 2, each with one line."""
    from bench import serving

    cases = [
        (["--launch", "--serve-arg=--device"], "pass --model, --model-path, --device"),
        (["--base-url", "http://127.0.0.1:1", "--stub-engine-steps-per-s", "5"],
         "needs --launch"),
        (["--launch", "--random-range-ratio", "2"], "--random-range-ratio must be in"),
        (["--launch", "--serve-arg=--api-key", "--serve-arg=k"], "drop --serve-arg=--api-key"),
        (["--launch", "--model", str(REPO / "nowhere")], "no config.json"),
    ]
    for args, message in cases:
        try:
            code = serving.main(args)
        except SystemExit as done:
            code = done.code
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (args, code, out, err)
        assert message in err.strip().splitlines()[-1], (args, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("pythonpath", [None, str(REPO)])
def test_run_as_a_script_it_says_to_run_it_as_a_module(pythonpath, tmp_path):
    """``python bench/serving.py`` (no flags), whether or not its imports resolve."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    p = subprocess.run([sys.executable, str(REPO / "bench" / "serving.py")], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "", (p.returncode, p.stdout)
    assert "run it from the repository root as a module" in p.stderr, p.stderr
    assert "python -m bench.serving" in p.stderr and "Traceback" not in p.stderr
