"""Flag validators shared by `serve` and `generate`.

Each check is pure apart from reading the model's ``config.json`` (and asking torch
whether CUDA is there); a failure raises :class:`UsageError`, which the command prints
as one line and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from elasticep.models.config import SUPPORTED_FAMILIES

Check = tuple[object, str]  # (condition, message when it is falsy)

LOAD_FORMATS = ("auto", "safetensors", "dummy")  # as elasticep.models.loader.LOAD_FORMATS
LOAD_FORMAT_HELP = ("where weights come from: auto/safetensors read the checkpoint; dummy "
                    "draws them from a fixed seed on the device, so a directory with only "
                    "config.json runs a real model shape (benchmarks)")


def add_cuda_graph_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add ``--disable-cuda-graph`` (SGLang's name) to ``p``."""
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode eagerly instead of replaying CUDA graphs captured at "
                        "start-up (graphs apply on CUDA where a rank's step has no "
                        "collective: --ep-size 1 in generate)")


def add_load_format_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                             default: str | None = "auto", help_suffix: str = "") -> None:
    """Add ``--load-format`` (vLLM's name and choices) to ``p``."""
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=default,
                   help=LOAD_FORMAT_HELP + help_suffix)


class UsageError(ValueError):
    """A bad flag or flag combination; printed as one line, exit status 2."""


def raise_first_failure(checks: Iterable[Check]) -> None:
    """Raise :class:`UsageError` with the message of the first failed check."""
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def resolved_max_ep_size(args: argparse.Namespace) -> int:
    """``--max-ep-size``, defaulting to ``--ep-size``."""
    return args.max_ep_size if args.max_ep_size is not None else args.ep_size


def ep_flag_checks(args: argparse.Namespace, max_ep: int) -> list[Check]:
    """Checks of the expert-parallel and KV-cache flags both commands take."""
    return [
        (args.ep_size >= 1, f"--ep-size must be >= 1, got {args.ep_size}"),
        (max_ep >= args.ep_size,
         f"--max-ep-size ({max_ep}) must be >= --ep-size ({args.ep_size})"),
        (args.ep_num_redundant_experts >= 0, "--ep-num-redundant-experts must be >= 0"),
        (args.eplb_rebalance_num_iterations >= 1, "--eplb-rebalance-num-iterations must be >= 1"),
        (args.max_total_tokens >= 16, "--max-total-tokens must be >= 16"),
    ]


def static_backend_check(args: argparse.Namespace, max_ep: int) -> Check:
    """The plain baseline backend has no scale-up capacity."""
    return (args.elastic_ep_backend == "elastic" or max_ep == args.ep_size,
            "--elastic-ep-backend none cannot scale: drop --max-ep-size")


def check_device(device: str) -> None:
    """Raises:
        UsageError: ``--device cuda`` without a CUDA device.
    """
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but this torch build sees no CUDA device "
                             "(see README: installing the CUDA build of torch)")


def check_model_dir(model: str) -> str:
    """Resolve a checkpoint directory and check its family.

    Raises:
        UsageError: missing directory/config.json, or an unsupported ``model_type``.
    """
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model}: no such model directory (config.json not found)")
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--model {model}: unreadable config.json ({exc})") from None
    if model_type not in SUPPORTED_FAMILIES:
        raise UsageError(f"--model {model}: unsupported model family {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    return str(path.resolve())
