"""`elasticep generate`: offline completion of one prompt or a JSONL batch of prompts.

stdout carries only results (the completion text, or one JSON line per prompt with
``--prompts-file``); logs and progress bars go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import torch

from elasticep.config import DeploymentConfig
from elasticep.elastic.fault_injection import parse_faults
from elasticep.engine.limits import known_max_total_tokens, measure_rank_limits
from elasticep.engine.llm_engine import EngineConfig, LLMEngine, max_sequence_len
from elasticep.engine.request import SamplingParams
from elasticep.entrypoints import validate as checks
from elasticep.entrypoints.batch_driver import BatchDriver
from elasticep.entrypoints.deployment_args import add_deployment_arguments, deployment_config
from elasticep.entrypoints.validate import UsageError
from elasticep.frontend.incremental_text import cut_at_stop
from elasticep.frontend.tokenizer import load_tokenizer
from elasticep.models import load_model_config
from elasticep.models.loader import load_model
from elasticep.utils.gc_pauses import warn_long_collections
from elasticep.utils.text import unicode_problem

log = logging.getLogger("elasticep.generate")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="complete prompts with a local MoE model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help='JSONL file of {"prompt": ...}, run as one batch')
    p.add_argument("--max-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate per prompt, at most (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: draw from the most likely tokens whose "
                        "probabilities add up to P, in (0, 1]; 1 = all (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="draw from the K most likely tokens only; 0 = all (default: "
                        "%(default)s)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    groups = add_deployment_arguments(p)  # --ep-size > 1: one worker process per rank
    groups["fault tolerance"].add_argument(
        "--fault", default=None,
        help="fault injection (tests): e.g. kill:rank=2:step=10[:layer=3]; the "
             "ELASTICEP_FAULT environment variable works too")
    groups["logging and metrics"].add_argument(
        "--log-dir", default=None, help=checks.LOG_DIR_HELP)
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
        if spec.rank is not None and not 0 <= spec.rank < ep_size:
            raise UsageError(f"--fault: rank {spec.rank} is not a rank of this run "
                             f"(--ep-size {ep_size})")


def validate(args: argparse.Namespace
             ) -> tuple[DeploymentConfig, list[str | list[int]], SamplingParams]:
    """Check every flag before anything heavy is loaded.

    Returns:
        ``(deployment, prompts, sampling_params)``; ``deployment.model`` is the
        resolved model directory.

    Raises:
        UsageError: with a one-line message naming the flag (or file and line).
    """
    deployment = deployment_config(args)
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
    deployment = replace(deployment, model=checks.check_model_dir(args.model, args.load_format))
    checks.check_quantization(deployment.model, deployment.quantization)
    checks.check_model_config(deployment.model)
    if args.prompt is not None:
        problem = "must not be empty" if not args.prompt else unicode_problem(args.prompt)
        if problem:
            raise UsageError(f"--prompt {problem}")
    prompts = read_prompts(args.prompts_file) if args.prompts_file else [args.prompt]
    return deployment, prompts, params


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


def _generate_ep(cfg: DeploymentConfig, fault: str | None, ids: list[list[int]], params,
                 decode, log_dir: str | None) -> list[list[int]]:
    """Launch ``cfg.ep_size`` rank processes (one GPU each with --device cuda), spread the
    prompts over them, return generated ids. The ranks log to ``log_dir`` (None: a new
    temporary directory).

    Raises:
        RuntimeError: a rank exited while loading, or a request failed (its message
            names the rank and the reason, in one line).
    """
    with BatchDriver.launch(cfg, decode, fault=fault, log_dir=log_dir) as driver:
        outs = driver.generate(ids, params)
    failed = [f"prompt {i}: {o.error}" for i, o in enumerate(outs) if o.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [o.token_ids for o in outs]


def run(args: argparse.Namespace) -> int:
    """Load the model, run every prompt as one batch, print results; returns the exit code."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    try:
        dep, prompts, params = validate(args)
        if args.log_dir is not None and dep.ep_size > 1:  # before any rank starts
            checks.make_log_dir(args.log_dir, "elasticep-logs-")
    except UsageError as exc:
        print(f"elasticep generate: error: {exc}", file=sys.stderr)
        return 2
    # this process runs the model (one rank) or the batch's front-end (more)
    warn_long_collections(dep.gc_warning_threshold_s)
    try:
        tok = load_tokenizer(dep.model)
        ids = [p if isinstance(p, list) else tok(p).input_ids for p in prompts]
        kv = known_max_total_tokens(dep)  # CUDA: the engine refuses what does not fit
        check_fits(ids, args.max_tokens, max_sequence_len(
            load_model_config(dep.model), None if kv is None else EngineConfig(kv)))
        log.info("generating %d prompt(s), max_tokens=%d", len(ids), args.max_tokens)
        if dep.ep_size > 1:
            outs = _generate_ep(dep, args.fault, ids, params, tok.decode, args.log_dir)
        else:
            model = load_model(dep.model, dtype=getattr(torch, dep.dtype), device=dep.device,
                               load_format=dep.load_format, quantization=dep.quantization)
            limits = measure_rank_limits(dep, model.config, rank=0)
            log.info("limits: %d KV tokens, max_running_requests %d",
                     limits.max_total_tokens, limits.max_running_requests)
            engine = LLMEngine(model, limits.engine_config(
                enable_cuda_graph=not dep.disable_cuda_graph), detokenize=tok.decode)
            outs = engine.generate(ids, params)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"elasticep generate: error: {exc}", file=sys.stderr)
        return 2
    eos = set(load_model_config(dep.model).eos_token_ids)
    for i, out in enumerate(outs):
        text_ids = out[:-1] if out and out[-1] in eos else out
        text = cut_at_stop(tok.decode(text_ids), args.stop)
        if args.prompts_file:
            print(json.dumps({"index": i, "text": text, "token_ids": out}), flush=True)
        else:
            sys.stdout.write(text + "\n")
    return 0
