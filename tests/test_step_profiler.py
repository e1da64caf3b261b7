"""The per-rank step profiler (``ELASTICEP_TORCH_PROFILER_DIR``) and its summary.

* :func:`summarize_spans` on hand-made kernel spans: the GPU busy time is the union
  of overlapping intervals, kinds and the NCCL share add up, top kernels are ranked;
  :func:`summarize_profile` on a real CPU profile (no kernels there: zero GPU time, the
  host gap is the whole wall time; its host ops counted once a step), JSON-serialisable;
  device and host spans split alike from parsed and from raw Kineto events.
* :func:`profiler_settings`: defaults, and a one-line error for every bad value; the
  commands' up-front check turns it into a :class:`UsageError`.
* :class:`StepProfiler` under :class:`LockstepLoop` (fake engine doing real torch ops,
  fake 2-rank all_reduce): exactly COUNT steps after SKIP, both files, and a profiler
  that fails is dropped after one log line while the loop keeps serving.
* End to end: an EP2 CPU deployment of the demo model with the variables set writes
  ``rank0.json`` and ``rank1.json`` of the same window.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from _loop_fakes import fake_loop

from elasticep.elastic.step_loop import LockstepLoop
from elasticep.elastic.step_profiler import (
    CPU_ENV,
    DIR_ENV,
    STEPS_ENV,
    ProfilerSettings,
    StepProfiler,
    profiler_settings,
)
from elasticep.entrypoints.validate import UsageError, env_profiler
from elasticep.utils.profile_summary import (
    Span,
    event_spans,
    idle_gaps,
    launch_delays,
    profile_spans,
    summarize_profile,
    summarize_spans,
)
from elasticep_testkit.paths import DEMO_MODEL


# ---------------------------------------------------------------------- the summary
def test_summary_of_hand_made_spans():
    spans = [
        Span("ncclDevKernel_AllToAll", 0.0, 400.0),      # overlaps the next two
        Span("paged_decode_attn_kernel", 100.0, 300.0),
        Span("nvjet_gemv_bf16", 350.0, 550.0),
        Span("argmax_kernel", 1000.0, 1100.0),           # after a 450 us gap
        Span("nvjet_gemv_bf16", 2000.0, 2300.0),
        Span("rms_norm_kernel", 2100.0, 2150.0),         # inside the previous one
    ]
    s = summarize_spans(spans, steps=2, wall_s=0.004)
    # union: [0, 550] + [1000, 1100] + [2000, 2300] = 950 us over 2 steps
    assert s["gpu_busy_ms_per_step"] == 0.475
    assert s["step_wall_ms"] == 2.0
    assert s["host_gap_ms_per_step"] == 1.525
    assert s["kernels_per_step"] == 3.0
    assert s["gpu_ms_per_step_by_kind"] == {"attention": 0.1, "experts": 0.25, "exchange": 0.2,
                                            "sampling": 0.05, "other": 0.025}
    assert s["nccl_ms_per_step"] == 0.2
    assert s["top_kernels_ms_per_step"][:2] == [["nvjet_gemv_bf16", 0.25, 1.0],
                                                ["ncclDevKernel_AllToAll", 0.2, 0.5]]
    assert len(s["top_kernels_ms_per_step"]) == 5
    assert "host_top_ms_per_step" not in s
    assert json.loads(json.dumps(s)) == s
    with pytest.raises(ValueError, match="steps must be >= 1"):
        summarize_spans(spans, steps=0, wall_s=1.0)
    # gaps: 550 -> 1000 (after the gemv, which ended last) and 1100 -> 2000
    assert s["idle_ms_per_step"] == 0.675
    assert s["longest_gaps_ms_per_step"] == 0.675
    assert s["idle_by_neighbours_ms_per_step"] == [
        ["argmax_kernel -> nvjet_gemv_bf16", 0.45, 0.5, 900.0],
        ["nvjet_gemv_bf16 -> argmax_kernel", 0.225, 0.5, 450.0]]


def test_idle_gaps_charge_each_gap_to_its_neighbours():
    # two steps of: kernel a, a 2 us wait gap, kernel b; 100 us between the steps
    spans = [Span("a", 0.0, 10.0), Span("b", 12.0, 20.0),
             Span("a", 120.0, 130.0), Span("b", 132.0, 140.0)]
    g = idle_gaps(spans, steps=2)
    assert g["idle_ms_per_step"] == 0.052
    assert g["longest_gaps_ms_per_step"] == 0.051  # the 2 longest (100, 2 us) over 2 steps
    assert g["idle_by_neighbours_ms_per_step"] == [["b -> a", 0.05, 0.5, 100.0],
                                                   ["a -> b", 0.002, 1.0, 2.0]]
    assert idle_gaps([], steps=1)["idle_by_neighbours_ms_per_step"] == []


def test_launch_delay_is_the_wait_for_the_first_kernel_after_the_call():
    kernels = [Span("k", 50.0, 60.0), Span("k", 300.0, 310.0)]
    host = [Span("cudaGraphLaunch", 0.0, 40.0), Span("cudaGraphLaunch", 200.0, 280.0),
            Span("aten::mm", 0.0, 5.0)]
    assert launch_delays(kernels, host) == {"launches": 2, "launch_host_ms": 0.06,
                                            "launch_to_gpu_ms": 0.075}
    assert launch_delays(kernels, [Span("aten::mm", 0.0, 5.0)]) is None
    assert summarize_spans(kernels, 2, 0.001, host)["graph_launch"]["launches"] == 2


CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
# (name, device, start us, end us, GPU user annotation): one kernel, one host op
EVENTS = [("aten::mm", CPU, 0, 90, False), ("gemv", CUDA, 10, 30, False),
          ("ProfilerStep#1", CUDA, 5, 95, True), ("nccl:all_to_all", CUDA, 40, 60, True),
          ("ProfilerStep#1", CPU, 0, 100, False)]


def test_spans_split_kernels_from_host_events():
    parsed = [SimpleNamespace(name=n, device_type=d, is_user_annotation=a,
                              time_range=SimpleNamespace(start=s, end=e))
              for n, d, s, e, a in EVENTS]
    want = ([Span("gemv", 10.0, 30.0)], [Span("aten::mm", 0.0, 90.0)])
    assert event_spans(parsed) == want

    def kineto(n, d, s, e, a):  # the raw results' accessors (nanoseconds)
        return SimpleNamespace(name=lambda: n, device_type=lambda: d,
                               start_ns=lambda: s * 1000, duration_ns=lambda: (e - s) * 1000,
                               is_user_annotation=lambda: a)

    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        events=lambda: [kineto(*ev) for ev in EVENTS])))
    assert profile_spans(prof) == want
    # a torch whose raw events lack an accessor: the parsed events instead
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(
        events=lambda: [SimpleNamespace()])), events=lambda: parsed)
    assert profile_spans(prof) == want


def test_summary_of_a_real_cpu_profile():
    x = torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            x = torch.tanh(x @ x)
    s = summarize_profile(prof, steps=3, wall_s=0.006)
    assert any(ev.name == "aten::mm" for ev in prof.events())  # it did record the ops
    assert s["steps"] == 3 and s["step_wall_ms"] == 2.0
    assert s["kernels_per_step"] == 0 and s["gpu_busy_ms_per_step"] == 0
    assert s["host_gap_ms_per_step"] == 2.0
    assert s["top_kernels_ms_per_step"] == []
    host = {name: (ms, n) for name, ms, n in s["host_top_ms_per_step"]}
    assert host["aten::mm"][1] == 1.0 and host["aten::tanh"][1] == 1.0  # once a step
    json.dumps(s)


# ---------------------------------------------------------------------- the variables
def test_settings_from_the_environment(tmp_path):
    assert profiler_settings({}) is None
    assert profiler_settings({DIR_ENV: ""}) is None
    assert profiler_settings({DIR_ENV: str(tmp_path)}) == ProfilerSettings(tmp_path, 20, 10, True)
    got = profiler_settings({DIR_ENV: str(tmp_path / "new"), STEPS_ENV: "0:3", CPU_ENV: "0"})
    assert got == ProfilerSettings(tmp_path / "new", 0, 3, False)


@pytest.mark.parametrize("env, message", [
    ({STEPS_ENV: "5"}, "ELASTICEP_TORCH_PROFILER_STEPS must be SKIP:COUNT"),
    ({STEPS_ENV: "a:3"}, "ELASTICEP_TORCH_PROFILER_STEPS must be SKIP:COUNT"),
    ({STEPS_ENV: "-1:3"}, "ELASTICEP_TORCH_PROFILER_STEPS must be SKIP:COUNT"),
    ({STEPS_ENV: "4:0"}, "got '4:0'"),
    ({CPU_ENV: "yes"}, "ELASTICEP_TORCH_PROFILER_CPU must be 0 or 1, got 'yes'"),
])
def test_bad_values_are_one_line_errors(tmp_path, monkeypatch, env, message):
    with pytest.raises(ValueError, match=message) as err:
        profiler_settings({DIR_ENV: str(tmp_path), **env})
    assert "\n" not in str(err.value)
    for name, value in {DIR_ENV: str(tmp_path), **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=message):  # what serve/generate/join print
        env_profiler()


def test_dir_must_be_a_directory_and_companions_need_it(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        profiler_settings({DIR_ENV: str(f)})
    with pytest.raises(ValueError, match="ELASTICEP_TORCH_PROFILER_STEPS is set but "
                                         "ELASTICEP_TORCH_PROFILER_DIR is not"):
        profiler_settings({STEPS_ENV: "1:2"})


def test_from_env_logs_a_bad_value_and_serves_unprofiled(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        assert StepProfiler.from_env(3, environ={DIR_ENV: str(tmp_path), STEPS_ENV: "x"}) is None
    assert [r.getMessage().startswith("rank 3: torch profiler off: ELASTICEP_TORCH_PROFILER_STEPS")
            for r in caplog.records] == [True]
    assert StepProfiler.from_env(3, environ={}) is None


# ---------------------------------------------------------------------- under the loop
def _loop(monkeypatch, tokens: list[int], profiler: StepProfiler) -> LockstepLoop:
    """Rank 0 of 2 serving one ``tokens[i]``-token sequence at step i (real torch ops);
    the peer has 2 tokens at every step, so every iteration works."""
    x = [torch.randn(16, 16)]

    def work() -> None:
        x[0] = torch.tanh(x[0] @ x[0])

    loop, _, _ = fake_loop(monkeypatch, 0, [[n] for n in tokens], 2, work=work,
                           profiler=profiler)
    return loop


def test_loop_profiles_the_window_and_writes_both_files(monkeypatch, tmp_path):
    prof = StepProfiler(ProfilerSettings(tmp_path, skip=4, count=3), rank=0)
    loop = _loop(monkeypatch, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], prof)
    for i in range(9):
        loop.step()
        assert (tmp_path / "rank0.json").exists() == (i >= 6), i  # steps 4..6, then written
    assert loop.profiler is None and prof.finished and loop.stats.steps == 9
    row = json.loads((tmp_path / "rank0.json").read_text())
    assert row["rank"] == 0 and row["epoch"] == 0 and row["steps"] == 3
    assert row["batch_tokens"] == [5, 6, 7] and row["max_batch_tokens"] == [5, 6, 7]
    assert len(row["step_wall_ms_each"]) == 3 and row["step_wall_ms"] > 0
    assert row["unprofiled_steps"] == 3  # steps 0..2 (step 3 is the warm-up)
    assert row["activities"] == ["cpu"] and row["kernels_per_step"] == 0
    trace = json.loads((tmp_path / "rank0.trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    assert [n for n, _, c in row["host_top_ms_per_step"] if n == "aten::mm"] == ["aten::mm"]
    # only the window's 3 steps: ProfilerStep#1..3 (step 0 of the schedule is the warm-up)
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
        "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_a_failing_profiler_is_dropped_after_one_line(monkeypatch, tmp_path, caplog):
    def broken(**kwargs):
        raise RuntimeError("CUPTI said no")

    prof = StepProfiler(ProfilerSettings(tmp_path, skip=1, count=2), 0, profile_factory=broken)
    loop = _loop(monkeypatch, [1, 2, 3, 4], prof)
    with caplog.at_level(logging.ERROR):
        for _ in range(4):
            loop.step()
    assert loop.stats.steps == 4 and loop.profiler is None
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0: torch profiler failed, profiling dropped: RuntimeError: CUPTI said no"]
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------- end to end
@pytest.mark.timeout(120)
def test_ep2_deployment_writes_one_file_per_rank(tmp_path):
    from elasticep.config import DeploymentConfig
    from elasticep.engine.request import SamplingParams
    from elasticep.entrypoints.batch_driver import BatchDriver

    out = tmp_path / "prof"
    cfg = DeploymentConfig(model=str(DEMO_MODEL), ep_size=2, max_ep_size=2,
                           elastic_ep_backend="none", max_total_tokens=512)
    env = {DIR_ENV: str(out), STEPS_ENV: "2:3"}
    with BatchDriver.launch(cfg, lambda ids: "", env=env, ready_timeout_s=90) as driver:
        outs = driver.generate([[1, 2, 3, 4], [5, 6, 7]],
                               SamplingParams(max_tokens=8, ignore_eos=True), timeout_s=60)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    rows = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, row in enumerate(rows):
        assert (row["rank"], row["steps"], row["epoch"]) == (rank, 3, 0)
        assert len(row["batch_tokens"]) == len(row["step_wall_ms_each"]) == 3
        assert row["unprofiled_steps"] == 1  # step 0; step 1 is the warm-up
        assert json.loads((out / f"rank{rank}.trace.json").read_text())["traceEvents"]
    # the same lockstep steps on both ranks: each agreed bound is the larger rank's batch
    assert rows[0]["max_batch_tokens"] == rows[1]["max_batch_tokens"] == [
        max(a, b) for a, b in zip(rows[0]["batch_tokens"], rows[1]["batch_tokens"], strict=True)]
    assert sum(rows[0]["batch_tokens"]) + sum(rows[1]["batch_tokens"]) >= 3  # work in it
