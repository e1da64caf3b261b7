"""bench/serving.py over several concurrencies against one server and one engine.

Starting a real-shape deployment (48 layers, graph capture) takes about a minute, and so
does loading the in-process engine, so a sweep starts `elasticep serve` once, runs the
served benchmark at each ``--concurrencies`` value C with ``--prompts-per-concurrency``
x C prompts, stops the server, then loads one ``LLMEngine`` (graphs up to the largest C)
and runs the same requests at each C. Prints one JSON line per C, in bench/serving.py's
shape, with ``engine`` and ``served_over_engine`` filled in.

Both sides get the same step budget (a served rank's ``--chunked-prefill-size`` and
``--max-num-batched-tokens``, defaults resolved as the ranks resolve them), so the
engine's prefill steps are as large as the ranks' and the comparison is of the served
path, not of two schedules. Both sides get the same KV cache: the engine holds the
largest C requests at once, and unless a ``--serve-arg`` sets ``--max-total-tokens``,
the server's ranks are given that many tokens too. Otherwise a rank sizes its cache from its share of the GPU, which with
``--max-ep-size 2`` on one GPU is half of it, and it may hold fewer sequences than the
engine (at the Qwen3-30B-A3B shape, fewer than 64 of 512 tokens): the comparison would
then measure queueing, not the per-token speed of the served path.

    python -m bench.serving_sweep --concurrencies 1,16,64,256 --device cuda \\
        --model DIR --load-format dummy --dtype bfloat16 --ignore-eos \\
        --random-input-len 256 --random-output-len 256 --random-range-ratio 1

Every other flag is bench/serving.py's (``--launch`` is implied).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

from bench import serving
from bench._commit import commit
from elasticep.engine import limits
from elasticep_testkit.harness.serve_process import ServeProcess
from elasticep_testkit.serving.engine_baseline import kv_tokens_for, load_engine, run_engine
from elasticep_testkit.serving.metrics import summarize


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], int]:
    """(bench/serving.py's args, the concurrencies, prompts per concurrency)."""
    ap = argparse.ArgumentParser(prog="python -m bench.serving_sweep",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--concurrencies", default="1,16,64,256")
    ap.add_argument("--prompts-per-concurrency", type=int, default=4)
    ours, rest = ap.parse_known_args(argv)
    try:
        cs = [int(x) for x in ours.concurrencies.split(",")]
    except ValueError:
        ap.error("--concurrencies takes integers, e.g. 1,16,64,256")
    if not cs or min(cs) < 1 or ours.prompts_per_concurrency < 1:
        ap.error("--concurrencies and --prompts-per-concurrency must be >= 1")
    args = serving.parse_args(["--launch", *rest])
    if args.stub_engine_steps_per_s is not None:
        ap.error("the sweep measures a real engine: not with --stub-engine-steps-per-s")
    return args, cs, ours.prompts_per_concurrency


def served_step_budget(flags: list[str], device: str) -> tuple[int | None, int]:
    """(chunked_prefill_size, max_num_batched_tokens) that the served ranks run with,
    from ``serve``'s flags, their defaults resolved as :mod:`elasticep.engine.limits`
    resolves them (pure)."""
    def flag(name: str) -> int | None:
        return int(flags[flags.index(name) + 1]) if name in flags else None

    resolved = limits.RankLimits(1, 1, 1, limits.resolve_chunk(flag("--chunked-prefill-size"),
                                                               device),
                                 flag("--max-num-batched-tokens"))
    config = resolved.engine_config()
    return config.chunked_prefill_size, config.max_batch_tokens


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exit 1 if any request failed."""
    args, cs, per_c = parse(argv)
    runs: list[tuple[argparse.Namespace, list]] = []
    for c in cs:
        a = copy.copy(args)
        a.max_concurrency, a.num_prompts = c, per_c * c
        runs.append((a, serving.make_requests(a)))
    lines: list[dict[str, Any]] = []
    kv = max(kv_tokens_for(req, a.max_concurrency) for a, req in runs)
    flags = serving.serve_args(args)
    if "--max-total-tokens" not in flags:
        flags += ["--max-total-tokens", str(kv)]
    t0 = time.perf_counter()
    serve = ServeProcess.start(flags, log_dir=args.log_dir)
    start_s = time.perf_counter() - t0
    try:
        for a, requests in runs:
            line = {"bench": "serving", "commit": commit(),
                    "max_concurrency": a.max_concurrency, "num_prompts": a.num_prompts,
                    "random_input_len": a.random_input_len,
                    "random_output_len": a.random_output_len, "device": a.device,
                    "serve_args": flags[flags.index("--load-format") + 2:],
                    "serve_start_s": round(start_s, 1),
                    **serving.bench_served(a, [serve.url], requests)}
            print(json.dumps({"served": line}), file=sys.stderr, flush=True)
            lines.append(line)
    finally:
        serve.stop()  # the engine needs the device's memory
    cap = max(cs)
    t0 = time.perf_counter()
    chunk, budget = served_step_budget(flags, args.device)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype,
                         load_format=args.load_format, max_concurrency=cap,
                         max_total_tokens=kv, enable_cuda_graph=not args.disable_cuda_graph,
                         chunked_prefill_size=chunk, max_batch_tokens=budget)
    load_s = time.perf_counter() - t0
    failed = False
    for line, (a, requests) in zip(lines, runs, strict=True):
        warm = serving.warmup_requests(a, requests)
        run_engine(engine, warm, len(warm), True)
        results, duration = run_engine(engine, requests, a.max_concurrency, a.ignore_eos)
        line["engine"] = {"max_total_tokens": kv, "chunked_prefill_size": chunk,
                          "max_num_batched_tokens": budget, "load_s": round(load_s, 1),
                          **summarize(results, duration)}
        line["served_over_engine"] = serving.ratios(line, line["engine"])
        text = json.dumps(line)
        print(text, flush=True)
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(text + "\n")
        failed = failed or bool(line["errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
