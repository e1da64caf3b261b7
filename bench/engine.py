"""Throughput of our engine (N concurrent requests) vs transformers `generate` run one
request at a time on the same checkpoint, in the same run. Prints one JSON line.

Usage: python -m bench.engine [--model DIR] [--num-requests 8] [--max-tokens 64]
       [--dtype float32|bfloat16] [--device cpu|cuda] [--repeats 3] [--threads N]

``--threads`` sets torch's intra-op threads for both sides. On a CPU shared with other
busy processes, two OpenMP threads on two cores can wait at every parallel region for a
descheduled partner (both sides then run 10-50x slower, and the ratio is noise);
``--threads 1`` measures the same work without that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench._commit import commit
from elasticep.engine.llm_engine import LLMEngine
from elasticep.engine.request import SamplingParams
from elasticep_testkit.paths import DEMO_MODEL
from elasticep_testkit.prompts import gsm8k_prompts


def _prompts(tok, n: int) -> list[list[int]]:
    return [tok(p).input_ids for p in gsm8k_prompts(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved A/B runs; medians reported")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = _prompts(tok, args.num_requests)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    engine = LLMEngine.from_pretrained(args.model, dtype=dtype, device=args.device, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()

    def run_ours() -> float:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        return sum(len(o) for o in outs) / (time.perf_counter() - t0)

    @torch.no_grad()
    def run_ref() -> float:
        t0, n = time.perf_counter(), 0
        for p in prompts:  # one request at a time, as a plain transformers user would
            ids = torch.tensor([p], device=args.device)
            out = ref.generate(ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                               do_sample=False)
            n += out.shape[1] - len(p)
        return n / (time.perf_counter() - t0)

    engine.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up both
    with torch.no_grad():
        ref.generate(torch.tensor([prompts[0]], device=args.device), max_new_tokens=4, do_sample=False)
    # interleave A/B runs so machine noise hits both alike; report medians
    ours_runs, ref_runs = [], []
    for _ in range(args.repeats):
        ours_runs.append(run_ours())
        ref_runs.append(run_ref())

    ours_tps, ref_tps = statistics.median(ours_runs), statistics.median(ref_runs)
    print(json.dumps({
        "bench": "engine", "commit": commit(),
        "model": Path(args.model).name,
        "device": args.device,
        "dtype": args.dtype,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "ours_tokens_per_s": round(ours_tps, 1),
        "transformers_sequential_tokens_per_s": round(ref_tps, 1),
        "ratio": round(ours_tps / ref_tps, 2),
        "repeats": args.repeats,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
