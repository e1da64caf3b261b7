"""`elasticep generate`: offline completion of one prompt or a JSONL batch of prompts.

stdout carries only results (the completion text, or one JSON line per prompt with
``--prompts-file``); logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

import elasticep
from elasticep.elastic.config import DeploymentConfig
from elasticep.elastic.fault_injection import parse_faults
from elasticep.engine.llm_engine import EngineConfig, LLMEngine, max_sequence_len
from elasticep.engine.request import SamplingParams
from elasticep.entrypoints import validate as checks
from elasticep.entrypoints.batch_driver import BatchDriver
from elasticep.entrypoints.validate import UsageError
from elasticep.frontend.tokenizer import load_tokenizer
from elasticep.models import load_model_config
from elasticep.models.config import SUPPORTED_FAMILIES
from elasticep.utils.text import unicode_problem

log = logging.getLogger("elasticep.generate")


def default_model_dir() -> Path:
    """The demo model shipped inside the repository (needs nothing from ../shared)."""
    return Path(elasticep.__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="complete prompts with a local MoE model")
    p.add_argument("--model", default=str(default_model_dir()),
                   help=f"HF checkpoint directory ({', '.join(SUPPORTED_FAMILIES)}); "
                        "default: the embedded demo model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help='JSONL file of {"prompt": ...}, run as one batch')
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    checks.add_load_format_argument(p)
    checks.add_cuda_graph_argument(p)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV-cache capacity in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="most prompt tokens computed per step (SGLang's name): longer prompts "
                        "are split over steps that running decodes share; default: off")
    ep = p.add_argument_group("expert parallelism (--ep-size > 1 launches one worker process per rank)")
    ep.add_argument("--ep-size", type=int, default=1,
                    help="ranks; each hosts a share of the experts and serves its prompts")
    ep.add_argument("--max-ep-size", type=int, default=None, help="rank capacity (default --ep-size)")
    ep.add_argument("--ep-num-redundant-experts", type=int, default=0,
                    help="R extra physical expert slots over all ranks")
    ep.add_argument("--ep-dispatch-algorithm", choices=["static", "dynamic"], default="static")
    ep.add_argument("--elastic-ep-backend", choices=["elastic", "none"], default="elastic",
                    help="elastic: survive rank failures; none: plain torch.distributed "
                         "groups (Gloo on CPU, NCCL for CUDA tensors), no fault tolerance")
    ep.add_argument("--enable-eplb", action="store_true")
    ep.add_argument("--eplb-rebalance-num-iterations", type=int, default=1000)
    ep.add_argument("--fault", default=None,
                    help="fault injection (tests): e.g. kill:rank=2:step=10[:layer=3]; "
                         "the ELASTICEP_FAULT environment variable works too")
    return p


def read_prompts(path: str) -> list[str | list[int]]:
    """The prompts of a JSONL file, one object a line (blank lines skipped): either
    ``{"prompt": "..."}`` or ``{"prompt_token_ids": [int, ...]}`` (vLLM's name; what a
    model directory without a tokenizer needs).

    Raises:
        UsageError: unreadable file, a line that is not such an object, or no prompts.
    """
    where = f"--prompts-file {path}"
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: cannot read ({exc})") from None
    prompts: list[str | list[int]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: line {n}: not JSON ({exc.msg})") from None
        try:
            prompts.append(_prompt_of_row(row))
        except ValueError as exc:
            raise UsageError(f"{where}: line {n}: {exc}") from None
    if not prompts:
        raise UsageError(f"{where}: no prompts")
    return prompts


def _prompt_of_row(row: object) -> str | list[int]:
    """The prompt of one parsed JSONL line (pure).

    Raises:
        ValueError: naming what is wrong: not an object, no prompt key (listing the keys
            the line has), a prompt key of the wrong type, or a prompt that is not valid
            Unicode.
    """
    if not isinstance(row, dict):
        raise ValueError(f'expected a JSON object with a "prompt" or "prompt_token_ids" key, '
                         f"got a {type(row).__name__}")
    if "prompt_token_ids" in row:
        ids = row["prompt_token_ids"]
        if not (isinstance(ids, list) and ids
                and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError('"prompt_token_ids" must be a non-empty list of integers')
        return ids
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError(f'"prompt" must be a string, got {type(row["prompt"]).__name__}')
        problem = unicode_problem(row["prompt"])  # JSON's "\ud800" escape
        if problem:
            raise ValueError(f'"prompt" {problem}')
        return row["prompt"]
    keys = ", ".join(f'"{k}"' for k in row) or "none"
    raise ValueError(f'missing key "prompt" (or "prompt_token_ids"); the object has keys: '
                     f"{keys}")


def check_fault(fault: str | None, ep_size: int) -> None:
    """Parse ``--fault`` and ``$ELASTICEP_FAULT`` up front (workers would die on a bad
    spec) and check that ``--fault`` names a rank of this run.

    Raises:
        UsageError: a malformed spec, or ``--fault`` that cannot fire.
    """
    checks.env_fault()
    try:
        specs = parse_faults(fault)
    except ValueError as exc:
        raise UsageError(f"--fault: {exc}") from None
    if specs and ep_size == 1:
        raise UsageError("--fault kills a worker rank: it needs --ep-size > 1")
    for spec in specs:
        if not 0 <= spec.rank < ep_size:
            raise UsageError(f"--fault: rank {spec.rank} is not a rank of this run "
                             f"(--ep-size {ep_size})")


def validate(args: argparse.Namespace) -> tuple[str, list[str | list[int]], SamplingParams]:
    """Check every flag before anything heavy is loaded.

    Returns:
        ``(model_dir, prompts, sampling_params)``.

    Raises:
        UsageError: with a one-line message naming the flag (or file and line).
    """
    max_ep = checks.resolved_max_ep_size(args)
    checks.raise_first_failure([
        *checks.ep_flag_checks(args, max_ep),
        (args.max_num_seqs >= 1, "--max-num-seqs must be >= 1"),
        (args.chunked_prefill_size is None or args.chunked_prefill_size >= 1,
         f"--chunked-prefill-size must be >= 1, got {args.chunked_prefill_size}"),
        (args.chunked_prefill_size is None or args.ep_size == 1,
         "--chunked-prefill-size is not passed to EP ranks yet: use it with --ep-size 1"),
        checks.static_backend_check(args, max_ep),
    ])
    check_fault(args.fault, args.ep_size)
    checks.env_profiler()
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
    )
    try:
        params.validate()
    except ValueError as exc:  # "top_p must be ..." -> "--top-p must be ..."
        field, _, rest = str(exc).partition(" ")
        raise UsageError(f"--{field.replace('_', '-')} {rest}") from None
    checks.check_device(args.device)
    model = checks.check_model_dir(args.model)
    if args.prompt is not None:
        problem = "must not be empty" if not args.prompt else unicode_problem(args.prompt)
        if problem:
            raise UsageError(f"--prompt {problem}")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt]
    return model, prompts, params


def check_fits(prompts: list[list[int]], max_tokens: int, limit: int) -> None:
    """Every prompt plus ``--max-tokens`` fits the engine's longest sequence (pure); the
    engine would cut such an output short without a word (serve answers it with a 400).

    Args:
        prompts: token ids per prompt.
        max_tokens: ``--max-tokens``.
        limit: the longest sequence in tokens (:func:`max_sequence_len`).

    Raises:
        UsageError: naming the first prompt that does not fit.
    """
    for i, ids in enumerate(prompts):
        if len(ids) + max_tokens > limit:
            raise UsageError(f"prompt {i}: {len(ids)} tokens + --max-tokens {max_tokens} does "
                             f"not fit the longest sequence, {limit} tokens (the model's "
                             "context, and the KV cache: --max-total-tokens)")


def _trim_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def _generate_ep(args: argparse.Namespace, ids: list[list[int]], params, decode) -> list[list[int]]:
    """Launch ``--ep-size`` rank processes (one GPU each with --device cuda), spread the
    prompts over them, return generated ids.

    Raises:
        RuntimeError: a request failed (its message names the rank and the reason).
    """
    cfg = DeploymentConfig(
        model=args.model, dtype=args.dtype, device=args.device, ep_size=args.ep_size,
        max_ep_size=checks.resolved_max_ep_size(args),
        ep_num_redundant_experts=args.ep_num_redundant_experts,
        ep_dispatch_algorithm=args.ep_dispatch_algorithm, enable_eplb=args.enable_eplb,
        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
        elastic_ep_backend=args.elastic_ep_backend, max_total_tokens=args.max_total_tokens,
        max_num_seqs=args.max_num_seqs, load_format=args.load_format,
        disable_cuda_graph=args.disable_cuda_graph,
    )
    with BatchDriver.launch(cfg, decode, fault=args.fault) as driver:
        outs = driver.generate(ids, params)
    failed = [f"prompt {i}: {o.error}" for i, o in enumerate(outs) if o.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [o.token_ids for o in outs]


def run(args: argparse.Namespace) -> int:
    """Load the model, run every prompt as one batch, print results; returns the exit code."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        model, prompts, params = validate(args)
    except UsageError as exc:
        print(f"elasticep generate: error: {exc}", file=sys.stderr)
        return 2
    args = argparse.Namespace(**vars(args) | {"model": model})  # the resolved directory
    try:
        tok = load_tokenizer(args.model)
        ids = [p if isinstance(p, list) else tok(p).input_ids for p in prompts]
        check_fits(ids, args.max_tokens, max_sequence_len(
            load_model_config(args.model), EngineConfig(max_total_tokens=args.max_total_tokens)))
        log.info("generating %d prompt(s), max_tokens=%d", len(ids), args.max_tokens)
        if args.ep_size > 1:
            outs = _generate_ep(args, ids, params, tok.decode)
        else:
            engine = LLMEngine.from_pretrained(
                args.model,
                dtype=getattr(torch, args.dtype),
                device=args.device,
                config=EngineConfig(max_total_tokens=args.max_total_tokens, max_num_seqs=args.max_num_seqs,
                                    enable_cuda_graph=not args.disable_cuda_graph,
                                    chunked_prefill_size=args.chunked_prefill_size),
                detokenize=tok.decode,
                load_format=args.load_format,
            )
            outs = engine.generate(ids, params)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"elasticep generate: error: {exc}", file=sys.stderr)
        return 2
    eos = set(load_model_config(args.model).eos_token_ids)
    for i, out in enumerate(outs):
        text_ids = out[:-1] if out and out[-1] in eos else out
        text = _trim_stop(tok.decode(text_ids), list(args.stop))
        if args.prompts_file:
            print(json.dumps({"index": i, "text": text, "token_ids": out}), flush=True)
        else:
            sys.stdout.write(text + "\n")
    return 0
