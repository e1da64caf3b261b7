"""Serving benchmark in the shape of SGLang's ``bench_serving``: streamed completions
against a running `elasticep serve` (``--base-url``) or one it starts (``--launch``),
one JSON line of throughput and latency (TTFT, TPOT, ITL, E2E: mean, median, p99 in ms),
and the TTFT of the first request, sent alone before the warm-up (``ttft_first_ms``,
``ttft_first_over_median``: a fresh ``--launch`` server's cold start on the request path),
where the measured run's first tokens spent their time (``first_token_trace``: per
stage p50/p99 from the server's ``/debug/first_token_trace``), and the client's own CPU
over the measured run (``client_cpu_s``, and ``client_cpu_share`` of its duration: near 1,
the client, not the server, set the pace).

Run it from the repository root as a module (it imports ``elasticep_testkit``):

    python -m bench.serving --launch --num-prompts 64 --max-concurrency 16 \\
        --random-input-len 256 --random-output-len 256 --random-range-ratio 1 --ignore-eos
    python -m bench.serving --base-url http://127.0.0.1:30000 --model DIR ...
    python -m bench.serving --base-url http://node0:30000 http://node1:30000 ...

``--engine-baseline`` runs the same requests through the in-process ``LLMEngine`` (same
model, device, dtype, load format; the same concurrency cap) after the served run and
adds the served / engine ratios. A server with ``--api-key`` takes it from
``$OPENAI_API_KEY`` (as bench_serving). ``--stub-engine-steps-per-s S`` (with ``--launch``)
serves the real front-end over stub ranks that emit one token per running request
every 1/S seconds, so the front-end's own ceiling is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # `python bench/serving.py`: a script
    # its imports may even resolve (an editable install, $PYTHONPATH), but the usage it
    # would print names `python -m bench.serving`: say how to run it, before anything
    sys.exit("bench/serving.py: error: run it from the repository root as a module: "
             "`python -m bench.serving --launch ...` or `python -m bench.serving "
             "--base-url URL ...` (`--help` for the flags)")

try:
    import httpx

    from bench._commit import commit
    from elasticep.frontend.tokenizer import TokenIdsOnlyTokenizer, load_tokenizer
    from elasticep_testkit.harness.serve_process import ServeProcess
    from elasticep_testkit.serving import stub_engine
    from elasticep_testkit.serving.client import run_requests
    from elasticep_testkit.serving.datasets import (
        DATASETS,
        BenchRequest,
        gsm8k_requests,
        random_requests,
    )
    from elasticep_testkit.serving.metrics import DIFFERENCES_FROM_SGLANG, first_errors, summarize
except ModuleNotFoundError as _exc:  # run as a script, not from the repository root
    sys.exit(f"bench/serving.py: error: {_exc}; run it from the repository root as "
             "`python -m bench.serving ...`")

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "tiny-qwen3-moe"
# flags this bench owns and passes to serve itself (the baseline must use the same)
OWNED = ("--model", "--model-path", "--device", "--dtype", "--load-format",
         "--disable-cuda-graph", "--host", "--port", "--dist-init-addr", "--log-dir")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, named as bench_serving's where it has them."""
    ap = argparse.ArgumentParser(prog="python -m bench.serving",
                                 description=__doc__.split("\n\n")[0])
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", nargs="+", metavar="URL",
                        help="a running server, e.g. http://127.0.0.1:30000; several: the "
                        "front-ends of one deployment (requests spread over them, and one "
                        "that loses its front-end is sent again to the next)")
    target.add_argument("--launch", action="store_true",
                        help="start `elasticep serve` on free loopback ports for the run")
    m = ap.add_argument_group("model (passed to serve with --launch; the baseline uses it)")
    m.add_argument("--model", default=str(DEMO), help="checkpoint dir (default: the demo)")
    m.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    m.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    m.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default="auto")
    m.add_argument("--disable-cuda-graph", action="store_true")
    m.add_argument("--serve-arg", action="append", default=[],
                   help="another serve flag, verbatim (repeatable: --serve-arg=--ep-size "
                        "--serve-arg=2)")
    m.add_argument("--log-dir", default=None, help="serve's logs (default: a temp dir)")
    d = ap.add_argument_group("load")
    d.add_argument("--dataset-name", choices=DATASETS, default="random")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: all at once)")
    d.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no cap)")
    d.add_argument("--random-input-len", type=int, default=256)
    d.add_argument("--random-output-len", type=int, default=256,
                   help="tokens per completion (gsm8k too)")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [ratio * len, len] (1: fixed lengths)")
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--ignore-eos", action="store_true")
    d.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as an error")
    o = ap.add_argument_group("output")
    o.add_argument("--output-file", default=None, help="append the JSON line here too")
    o.add_argument("--engine-baseline", action="store_true",
                   help="also run the requests through the in-process LLMEngine")
    o.add_argument("--engine-max-total-tokens", type=int, default=None,
                   help="the baseline's KV cache (default: what its batch needs)")
    s = ap.add_argument_group("stub engine (front-end ceiling)")
    s.add_argument("--stub-engine-steps-per-s", type=float, default=None,
                   help="with --launch: serve over stub ranks stepping this often")
    args = ap.parse_args(argv)
    problems = [
        (args.num_prompts >= 1, "--num-prompts must be >= 1"),
        (args.max_concurrency is None or args.max_concurrency >= 1,
         "--max-concurrency must be >= 1"),
        (args.random_input_len >= 1 and args.random_output_len >= 1,
         "--random-input-len and --random-output-len must be >= 1"),
        (0.0 <= args.random_range_ratio <= 1.0, "--random-range-ratio must be in [0, 1]"),
        (args.request_rate > 0, "--request-rate must be > 0 (or inf)"),
        (args.stub_engine_steps_per_s is None or args.launch,
         "--stub-engine-steps-per-s needs --launch"),
        (args.stub_engine_steps_per_s is None or args.stub_engine_steps_per_s > 0,
         "--stub-engine-steps-per-s must be > 0"),
        (args.stub_engine_steps_per_s is None or not args.engine_baseline,
         "--engine-baseline measures a real engine: not with --stub-engine-steps-per-s"),
        (not any(a.split("=", 1)[0] in OWNED for a in args.serve_arg),
         f"pass {', '.join(OWNED[:6])} as this bench's own flags, not --serve-arg (the "
         "baseline uses them too); the ports and log dir are chosen here"),
        (not (args.launch and any(a.split("=", 1)[0] == "--api-key" for a in args.serve_arg)),
         "--launch serves on loopback without a key: drop --serve-arg=--api-key (for a "
         "server with a key, use --base-url and $OPENAI_API_KEY)"),
        (Path(args.model, "config.json").is_file(), f"--model {args.model}: no config.json"),
    ]
    for ok, message in problems:
        if not ok:
            ap.error(message)  # one line, exit 2
    return args


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The run's requests from the dataset flags (token ids for a tokenizer-less model)."""
    tok = load_tokenizer(args.model)
    vocab = len(tok)
    tokenizer = None if isinstance(tok, TokenIdsOnlyTokenizer) else tok
    if args.dataset_name == "gsm8k":
        return gsm8k_requests(args.num_prompts, args.random_output_len,
                              args.random_range_ratio, args.seed, tokenizer)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed, tokenizer, vocab)


def serve_args(args: argparse.Namespace) -> list[str]:
    """The launched serve's flags (model, device, dtype, load format, then --serve-arg)."""
    out = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
           "--load-format", args.load_format]
    if args.disable_cuda_graph:
        out.append("--disable-cuda-graph")
    return out + list(args.serve_arg)


def warmup_requests(args: argparse.Namespace, requests: list[BenchRequest],
                    ) -> list[BenchRequest]:
    """What runs before the measured run, on both sides alike: the first ``C`` requests
    (the concurrency cap) at once, 4 tokens each, so that every batch size up to ``C``
    has run once (CPU kernels pick their code per shape on first use)."""
    cap = min(args.max_concurrency or len(requests), len(requests))
    return [BenchRequest(r.prompt, r.prompt_len, min(4, r.output_len), r.prompt_ids)
            for r in requests[:cap]]


def served_model(base_url: str) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        RuntimeError: the server did not answer 200 (e.g. 401 without the key).
    """
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    if r.status_code != 200:  # one line, not httpx's paragraph
        hint = " (set $OPENAI_API_KEY)" if r.status_code == 401 else ""
        raise RuntimeError(f"GET {base_url}/v1/models: HTTP {r.status_code}{hint}: "
                           f"{r.text[:200]}")
    return r.json()["data"][0]["id"]


def bench_served(args: argparse.Namespace, base_urls: list[str],
                 requests: list[BenchRequest],
                 stub_dir: Path | None = None) -> dict[str, Any]:
    """The first request alone, warm up (:func:`warmup_requests`), then run every
    request; the summary fields (with ``stub_dir``, the stub ranks' log dir: the
    ``stub`` fields too).

    ``ttft_first_ms`` is the TTFT of that first request, sent alone (the first request
    a server started with ``--launch`` sees: what a cold kernel, compiled on the request
    path, costs), and ``ttft_first_over_median`` its ratio to the measured run's
    ``median_ttft_ms`` (at concurrency 1, the steady TTFT): one request, so a noisy
    figure. ``differences_from_sglang`` lists where the metrics depart from
    bench_serving's (see :mod:`elasticep_testkit.serving.metrics`).

    ``base_urls``: the server, or a deployment's front-ends (the model id and the
    first-token trace are the first one's).
    """
    base_url = base_urls[0]
    model = served_model(base_url)
    warm = warmup_requests(args, requests)

    def warm_up(batch: list[BenchRequest]) -> list[Any]:
        res, _ = asyncio.run(run_requests(base_urls, model, batch, request_rate=math.inf,
                                          max_concurrency=len(batch), ignore_eos=True,
                                          seed=0, timeout_s=args.request_timeout))
        if first_errors(res):
            raise RuntimeError(f"a warm-up request failed: {first_errors(res)[0]}")
        return res

    first = warm_up(warm[:1])
    warm_up(warm)
    processes = serve_int_flag(args, "--api-server-count")
    first_token_traces(base_url, processes, reset=True)  # the measured run's requests only
    ranks = stub_ranks(args)
    before = stub_engine.read_stats(stub_dir, ranks) if stub_dir else None
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_requests(
        base_urls, model, requests, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, seed=args.seed,
        timeout_s=args.request_timeout))
    client_cpu = time.process_time() - cpu0
    out: dict[str, Any] = {"model_id": model, **summarize(results, duration),
                           "differences_from_sglang": list(DIFFERENCES_FROM_SGLANG),
                           "client_cpu_s": round(client_cpu, 3),
                           "client_cpu_share": round(client_cpu / duration, 3)}
    traces = first_token_traces(base_url, processes)
    out["first_token_trace"] = traces[0] if traces else None
    if processes > 1:
        # percentiles of parts do not add up to the whole's: each process's own
        out["first_token_trace_per_process"] = traces
    ttft = first[0].ttft
    out["ttft_first_ms"] = None if ttft is None else round(ttft * 1000.0, 3)
    out["ttft_first_over_median"] = (round(out["ttft_first_ms"] / out["median_ttft_ms"], 3)
                                     if ttft is not None and out["median_ttft_ms"] else None)
    if out["errors"]:
        out["error_samples"] = first_errors(results)
    if stub_dir is not None:
        out["stub"] = stub_engine.report(
            before, stub_engine.read_stats(stub_dir, ranks), args.stub_engine_steps_per_s,
            min(args.max_concurrency or len(requests), len(requests)),
            out["total_output_tokens"], duration)
    return out


def first_token_trace(base_url: str, reset: bool = False) -> dict[str, Any] | None:
    """The server's first-token breakdown (``GET /debug/first_token_trace``: per stage
    p50/p99 in ms, and the rank's steps to a first token) of the requests traced since
    the last reset, then reset it if ``reset``; None from a server without it."""
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{base_url}/debug/first_token_trace",
                  params={"reset": "true"} if reset else None, headers=headers, timeout=30)
    return r.json() if r.status_code == 200 else None


# fresh connections tried to reach every front-end process of the server
TRACE_TRIES = 200


def first_token_traces(base_url: str, processes: int,
                       reset: bool = False) -> list[dict[str, Any]]:
    """:func:`first_token_trace` of each of the server's ``processes`` front-end
    processes (``--api-server-count``; told apart by their ``pid``), each reached on
    connections of its own: whichever process accepts one answers it. Empty from a
    server without the trace.

    Raises:
        RuntimeError: fewer processes answered within :data:`TRACE_TRIES` connections.
    """
    seen: dict[Any, dict[str, Any]] = {}
    for _ in range(TRACE_TRIES if processes > 1 else 1):
        trace = first_token_trace(base_url, reset=reset)
        if trace is None:
            return []
        seen.setdefault(trace.get("pid"), trace)
        if len(seen) >= processes:
            return list(seen.values())
    raise RuntimeError(f"{len(seen)} of {processes} front-end processes answered "
                       f"/debug/first_token_trace in {TRACE_TRIES} connections")


def serve_int_flag(args: argparse.Namespace, name: str) -> int:
    """An integer serve flag among --serve-arg (default 1): ``--ep-size`` is the stub
    server's rank count, ``--api-server-count`` its front-end processes."""
    flags = [a for arg in args.serve_arg for a in arg.split("=", 1)]
    for flag, value in zip(flags, flags[1:], strict=False):
        if flag == name:
            return int(value)
    return 1


def stub_ranks(args: argparse.Namespace) -> int:
    """The stub server's rank count: its --ep-size among --serve-arg (default 1)."""
    return serve_int_flag(args, "--ep-size")


def bench_engine(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The same requests through the in-process engine; its summary fields."""
    from elasticep_testkit.serving.engine_baseline import kv_tokens_for, load_engine, run_engine

    cap = args.max_concurrency or len(requests)
    kv = args.engine_max_total_tokens or kv_tokens_for(requests, cap)
    t0 = time.perf_counter()
    engine = load_engine(args.model, device=args.device, dtype=args.dtype,
                         load_format=args.load_format, max_concurrency=cap,
                         max_total_tokens=kv, enable_cuda_graph=not args.disable_cuda_graph)
    load_s = time.perf_counter() - t0
    warm = warmup_requests(args, requests)
    run_engine(engine, warm, len(warm), True)
    results, duration = run_engine(engine, requests, cap, args.ignore_eos)
    return {"max_total_tokens": kv, "load_s": round(load_s, 1),
            **summarize(results, duration)}


def ratios(served: dict[str, Any], engine: dict[str, Any]) -> dict[str, float | None]:
    """served / engine for output tok/s and median TPOT (None where one side lacks it)."""
    def ratio(key: str) -> float | None:
        a, b = served.get(key), engine.get(key)
        return round(a / b, 3) if a and b else None
    return {"output_throughput": ratio("output_throughput"),
            "median_tpot_ms": ratio("median_tpot_ms")}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print (and append) one JSON line. Exit 1 if any request failed."""
    args = parse_args(argv)
    try:
        requests = make_requests(args)
    except ValueError as exc:
        print(f"bench/serving.py: error: {exc}", file=sys.stderr)
        return 2
    line: dict[str, Any] = {
        "bench": "serving", "commit": commit(), "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        # a string for inf: json.dumps would write Infinity, which strict JSON lacks
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency, "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "seed": args.seed,
        "ignore_eos": args.ignore_eos, "model": Path(args.model).name, "device": args.device,
        "dtype": args.dtype, "load_format": args.load_format,
        "serve_args": args.serve_arg, "cpu_count": os.cpu_count()}
    serve = None
    try:
        if args.launch:
            program = None
            if args.stub_engine_steps_per_s is not None:
                program = stub_engine.server_command(args.stub_engine_steps_per_s)
            serve = ServeProcess.start(serve_args(args), log_dir=args.log_dir,
                                       program=program)
            base_urls = [serve.url]
        else:
            base_urls = [u.rstrip("/") for u in args.base_url]
        stub_dir = (serve.log_path.parent if args.stub_engine_steps_per_s is not None
                    else None)
        line.update(bench_served(args, base_urls, requests, stub_dir))
    except (RuntimeError, TimeoutError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"bench/serving.py: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if serve is not None:
            serve.stop()  # before the baseline: it needs the device's memory
    if args.engine_baseline:
        line["engine"] = bench_engine(args, requests)
        line["served_over_engine"] = ratios(line, line["engine"])
    text = json.dumps(line)
    print(text, flush=True)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(text + "\n")
    return 1 if line["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
