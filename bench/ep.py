"""EP4 on the CPU: healthy and degraded throughput, repair time, elastic vs plain Gloo.

Prints one JSON line:
  - tokens_per_s_healthy: EP4 elastic backend, median of interleaved runs;
  - tokens_per_s_none: EP4 over plain Gloo groups (``--elastic-ep-backend none``), same
    run, interleaved with the above; elastic_vs_none = their ratio;
  - repair_and_redo_s: rank 3 is SIGKILLed mid-batch; the longest token gap across the
    kill of a request on a surviving rank (detection + epoch change + placement
    repair with orphan reload + step redo);
  - moved_request_gap_s: the same for the dead rank's requests (plus resubmission to a
    survivor and the prefill of prompt + generated tokens there);
  - orphan_reload_s: the slowest survivor's placement repair (R = 0, so every expert of
    the dead rank is reloaded from the checkpoint), from the worker logs;
  - tokens_per_s_one_dead: EP4 with rank 3 dead (3 ranks serve);
  - eplb_imbalance_before / _after: max/mean rank load of the demo model on GSM8K
    prompts (routing counted at ep_size 1) under the launch placement with 16 redundant
    slots on 4 ranks, and after ``rebalance_placement``.

Usage: python -m bench.ep [--num-prompts 16] [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench._commit import commit
from elasticep.config import DeploymentConfig
from elasticep.engine.request import SamplingParams
from elasticep.entrypoints.batch_driver import BatchDriver
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.prompts import gsm8k_prompts


def _prompts(tok, n: int) -> list[list[int]]:
    return [tok(p).input_ids for p in gsm8k_prompts(n)]


def _tokens_per_s(driver: BatchDriver, prompts, params) -> float:
    t0 = time.perf_counter()
    outs = driver.generate(prompts, params, timeout_s=600)
    dt = time.perf_counter() - t0
    if any(o.error for o in outs):
        raise RuntimeError([o.error for o in outs if o.error])
    return sum(len(o.token_ids) for o in outs) / dt


def _kill_run(driver: BatchDriver, prompts, params, victim: int, after: int) -> dict:
    """One batch with ``victim`` SIGKILLed after ``after`` tokens; stream timing around it.

    Survivors' requests pause for detection + repair + redo; the victim's requests also
    wait for the front-end to resubmit them and for their prefill on a survivor.
    """
    pid = driver.deployment.pids()[victim]
    tracker = driver.frontend.tracker
    events: list[tuple[float, str]] = []
    state: dict = {}

    def on_event(_i, ev):
        now = time.monotonic()
        events.append((now, ev.request_id))
        if len(events) == after:
            state["owner"] = {rid: tracker.rank_of(rid) for _, rid in events}
            state["t"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

    driver.generate(prompts, params, timeout_s=600, on_event=on_event)
    t_kill, owner = state["t"], state["owner"]
    last: dict[str, float] = {}
    gap = {"survivor": 0.0, "victim": 0.0}
    for t, rid in events:
        if rid in last and t > t_kill and last[rid] <= t_kill:
            kind = "victim" if owner.get(rid) == victim else "survivor"
            gap[kind] = max(gap[kind], t - last[rid])
        last[rid] = t
    return {"repair_and_redo_s": gap["survivor"], "moved_request_gap_s": gap["victim"]}


def _orphan_reload_s(log_dir: str) -> float:
    text = "\n".join(p.read_text() for p in Path(log_dir).glob("rank*.log"))
    times = [float(s) for s, n in re.findall(r"reconciled in ([\d.]+)s: (\d+) checkpoint reloads", text)
             if int(n) > 0]
    return max(times) if times else float("nan")


def _eplb_imbalance(tok, num_prompts: int, max_tokens: int) -> tuple[float, float]:
    """Count routing at ep_size 1, then compare the launch placement and a rebalance."""
    from elasticep.engine.llm_engine import LLMEngine
    from elasticep.eplb import (
        EPLBConfig,
        EPLBManager,
        compute_imbalance,
        initial_placement,
        rebalance_placement,
    )

    engine = LLMEngine.from_pretrained(DEMO_MODEL, progress=False)
    cfg = engine.model.config
    mgr = EPLBManager(cfg.num_hidden_layers, cfg.num_experts, EPLBConfig(window_size=4096))
    inner = engine.model.executor

    def recording(layer, hidden, ids, weights):
        mgr.record(layer, ids)
        return inner(layer, hidden, ids, weights)

    engine.model.executor = recording
    engine.generate(_prompts(tok, num_prompts), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    mgr.step()
    counts = mgr.window_counts()
    placement = initial_placement(cfg.num_hidden_layers, cfg.num_experts, 16, 4)
    balanced = rebalance_placement(counts, placement)
    before = float(compute_imbalance(counts, placement).mean())
    after = float(compute_imbalance(counts, balanced).mean())
    return before, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved A/B runs; medians reported")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    prompts = _prompts(tok, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base = DeploymentConfig(model=str(DEMO_MODEL), ep_size=4, max_ep_size=4, ep_num_redundant_experts=0)
    log_dir = tempfile.mkdtemp(prefix="bench-ep-")
    result: dict = {"bench": "ep", "ep_size": 4, "device": "cpu", "num_prompts": len(prompts),
                    "max_tokens": args.max_tokens, "ep_num_redundant_experts": 0}
    elastic = BatchDriver.launch(base, tok.decode, log_dir=os.path.join(log_dir, "elastic"))
    try:
        plain = BatchDriver.launch(DeploymentConfig(**{**base.__dict__, "elastic_ep_backend": "none"}),
                                   tok.decode, log_dir=os.path.join(log_dir, "none"))
        try:
            _tokens_per_s(elastic, prompts, params)  # warm-up both
            _tokens_per_s(plain, prompts, params)
            a, b = [], []
            for _ in range(args.repeats):
                a.append(_tokens_per_s(elastic, prompts, params))
                b.append(_tokens_per_s(plain, prompts, params))
        finally:
            plain.close()
        result["tokens_per_s_healthy"] = statistics.median(a)
        result["tokens_per_s_none"] = statistics.median(b)
        result["elastic_vs_none"] = result["tokens_per_s_healthy"] / result["tokens_per_s_none"]
        total = len(prompts) * args.max_tokens
        result.update(_kill_run(elastic, prompts, params, victim=3, after=total // 3))
        result["orphan_reload_s"] = _orphan_reload_s(os.path.join(log_dir, "elastic"))
        result["tokens_per_s_one_dead"] = statistics.median(
            _tokens_per_s(elastic, prompts, params) for _ in range(args.repeats))
    finally:
        elastic.close()
    before, after = _eplb_imbalance(tok, 64, args.max_tokens)
    result["eplb_imbalance_before"], result["eplb_imbalance_after"] = before, after
    result = {"commit": commit(), **result}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}),
          flush=True)


if __name__ == "__main__":
    main()
