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

log = logging.getLogger("elasticep.generate")


def default_model_dir() -> Path:
    """The demo model shipped inside the repository (needs nothing from ../shared)."""
    import elasticep

    return Path(elasticep.__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="complete prompts with a local MoE model")
    p.add_argument("--model", default=str(default_model_dir()), help="HF checkpoint directory")
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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV-cache capacity in tokens")
    p.add_argument("--max-num-seqs", type=int, default=64)
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


def _trim_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def _generate_ep(args: argparse.Namespace, ids: list[list[int]], params, decode) -> list[list[int]]:
    """Launch ``--ep-size`` rank processes (one GPU each with --device cuda), spread the
    prompts over them, return generated ids.

    Raises:
        RuntimeError: a request failed (its message names the rank and the reason).
    """
    from elasticep.elastic.config import DeploymentConfig
    from elasticep.entrypoints.batch_driver import BatchDriver

    cfg = DeploymentConfig(
        model=args.model, dtype=args.dtype, device=args.device, ep_size=args.ep_size,
        max_ep_size=args.max_ep_size or args.ep_size,
        ep_num_redundant_experts=args.ep_num_redundant_experts,
        ep_dispatch_algorithm=args.ep_dispatch_algorithm, enable_eplb=args.enable_eplb,
        eplb_rebalance_num_iterations=args.eplb_rebalance_num_iterations,
        elastic_ep_backend=args.elastic_ep_backend, max_total_tokens=args.max_total_tokens,
        max_num_seqs=args.max_num_seqs,
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
    import torch
    from transformers import AutoTokenizer

    from elasticep.engine.llm_engine import EngineConfig, LLMEngine
    from elasticep.engine.request import SamplingParams

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.prompts_file:
        lines = Path(args.prompts_file).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    else:
        prompts = [args.prompt]
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
        )
        params.validate()
        ids = [tok(p).input_ids for p in prompts]
        log.info("generating %d prompt(s), max_tokens=%d", len(ids), args.max_tokens)
        if args.ep_size > 1:
            outs = _generate_ep(args, ids, params, tok.decode)
        else:
            engine = LLMEngine.from_pretrained(
                args.model,
                dtype=getattr(torch, args.dtype),
                device=args.device,
                config=EngineConfig(max_total_tokens=args.max_total_tokens, max_num_seqs=args.max_num_seqs),
                detokenize=tok.decode,
            )
            outs = engine.generate(ids, params)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from elasticep.models import load_model_config

    eos = set(load_model_config(args.model).eos_token_ids)
    for i, out in enumerate(outs):
        text_ids = out[:-1] if out and out[-1] in eos else out
        text = _trim_stop(tok.decode(text_ids), list(args.stop))
        if args.prompts_file:
            print(json.dumps({"index": i, "text": text, "token_ids": out}), flush=True)
        else:
            sys.stdout.write(text + "\n")
    return 0
