"""Flag validators shared by `serve` and `generate`.

Each check is pure apart from reading the model's ``config.json`` (and asking torch
whether CUDA is there); a failure raises :class:`UsageError`, which the command prints
as one line and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import elasticep
from elasticep.config import LoadFormat
from elasticep.elastic.fault_injection import ENV_VAR, parse_faults
from elasticep.elastic.profiler_settings import profiler_settings

Check = tuple[object, str]  # (condition, message when it is falsy)


def default_model_dir() -> Path:
    """The demo model shipped inside the repository (needs nothing from ../shared)."""
    return Path(elasticep.__file__).resolve().parents[1] / "models" / "tiny-qwen3-moe"


def env_fault() -> str | None:
    """``$ELASTICEP_FAULT`` (test-only fault injection of the launch cohort, see
    :mod:`elasticep.elastic.fault_injection`), parsed up front: workers would die on a
    bad spec.

    Raises:
        UsageError: a malformed spec.
    """
    text = os.environ.get(ENV_VAR)
    try:
        parse_faults(text)
    except ValueError as exc:
        raise UsageError(f"{ENV_VAR}: {exc}") from None
    return text


def env_profiler() -> None:
    """Check the ranks' profiler variables (``$ELASTICEP_TORCH_PROFILER_DIR`` and its
    companions, see :mod:`elasticep.elastic.step_profiler`) up front: a rank would only
    log a bad value and serve unprofiled.

    Raises:
        UsageError: a malformed value, naming the variable.
    """
    try:
        profiler_settings()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


LOAD_FORMAT_HELP = ("where weights come from: auto/safetensors read the checkpoint; dummy "
                    "draws them from a fixed seed on the device, so a directory with only "
                    "config.json runs a real model shape (benchmarks)")


def add_load_format_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                             default: str | None = LoadFormat.AUTO.value,
                             help_suffix: str = "") -> None:
    """Add ``--load-format`` (vLLM's name and choices) to ``p`` (``join`` takes it too,
    with no default: the deployment's)."""
    p.add_argument("--load-format", choices=[m.value for m in LoadFormat], default=default,
                   help=LOAD_FORMAT_HELP + help_suffix)


def add_coordinator_timeout_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                                     ) -> None:
    """Add ``--coordinator-timeout`` (how long a node or a `join` tries to reach node 0)."""
    p.add_argument("--coordinator-timeout", type=float, default=60.0,
                   help="seconds to keep trying to reach the coordinator, at start-up and "
                        "after this node's ranks lost it (a partition, node 0 gone), before "
                        "giving up with an error; with serve --restart-failed-ranks, ranks "
                        "are relaunched if it answers within that time "
                        "(default: %(default)s)")


def add_gloo_ifname_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add ``--gloo-socket-ifname`` (the interface of the ranks' Gloo traffic)."""
    p.add_argument("--gloo-socket-ifname", default=None, metavar="IFACE[,IFACE]",
                   help="network interface(s) of this node's ranks for their Gloo groups "
                        "(sets GLOO_SOCKET_IFNAME for them); default: GLOO_SOCKET_IFNAME "
                        "if set, else the interface that routes to --dist-init-addr")


def apply_gloo_ifname(args: argparse.Namespace) -> None:
    """Check ``--gloo-socket-ifname`` and hand it to the ranks this command starts (they
    inherit the environment).

    Raises:
        UsageError: an interface of that name does not exist on this machine.
    """
    if not args.gloo_socket_ifname:
        return
    for name in args.gloo_socket_ifname.split(","):
        try:
            socket.if_nametoindex(name)
        except OSError:
            raise UsageError(f"--gloo-socket-ifname: no network interface {name!r} on this "
                             "machine (see `ip link`)") from None
    from elasticep.distributed.gloo_device import IFNAME_ENV  # imports torch.distributed

    os.environ[IFNAME_ENV] = args.gloo_socket_ifname


def coordinator_timeout_check(args: argparse.Namespace) -> Check:
    """``--coordinator-timeout`` is a positive number of seconds."""
    return (args.coordinator_timeout > 0,
            f"--coordinator-timeout must be > 0 seconds, got {args.coordinator_timeout:g}")


class UsageError(ValueError):
    """A bad flag or flag combination; printed as one line, exit status 2."""


def raise_first_failure(checks: Iterable[Check]) -> None:
    """Raise :class:`UsageError` with the message of the first failed check."""
    for ok, message in checks:
        if not ok:
            raise UsageError(message)


def port_check(flag: str, port: int, allow_zero: bool = True) -> Check:
    """A TCP port flag is in [0, 65535] (``allow_zero``: 0 means any free port)."""
    low = 0 if allow_zero else 1
    return (low <= port <= 65535, f"{flag} {port} is not a TCP port (must be in "
                                  f"[{low}, 65535])")


def check_address(flag: str, address: str, allow_zero_port: bool = False) -> tuple[str, int]:
    """Parse a ``HOST:PORT`` flag (every address flag goes through here).

    Returns:
        (host, port).

    Raises:
        UsageError: not HOST:PORT (a URL included), an empty host, or a port outside
            the TCP range.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        # "/": a URL (http://h:p) would pass as host "http://h" and be tried until
        # --coordinator-timeout runs out
        raise UsageError(f"{flag} must be HOST:PORT (no scheme or path), got {address!r}")
    raise_first_failure([port_check(flag, int(port), allow_zero_port)])
    return host, int(port)


def check_device(device: str) -> None:
    """Raises:
        UsageError: ``--device cuda`` without a CUDA device.
    """
    if device == "cuda":
        import torch  # seconds to import: only where CUDA is asked for

        if not torch.cuda.is_available():
            raise UsageError("--device cuda, but this torch build sees no CUDA device "
                             "(see README: installing the CUDA build of torch)")


def check_model_dir(model: str, load_format: str | LoadFormat = LoadFormat.AUTO) -> str:
    """Resolve a checkpoint directory and check its family, and that it holds weights
    unless ``load_format`` is dummy.

    Args:
        model: ``--model`` as given.
        load_format: ``--load-format``; auto/safetensors need ``*.safetensors`` files
            (or their index) beside ``config.json``.

    Raises:
        UsageError: missing directory/config.json, a config.json that is not an object,
            an unsupported ``model_type``, or a config-only directory without
            ``--load-format dummy`` (the rank would die reading weights otherwise, long
            after start).
    """
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model}: no such model directory (config.json not found)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"--model {model}: unreadable config.json ({exc})") from None
    if not isinstance(raw, dict):
        raise UsageError(f"--model {model}: config.json is not a JSON object (a "
                         f"{type(raw).__name__})")
    from elasticep.models.config import SUPPORTED_FAMILIES  # imports torch

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise UsageError(f"--model {model}: unsupported model family {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_FAMILIES)})")
    if LoadFormat(load_format) != LoadFormat.DUMMY and not has_weights(path):
        raise UsageError(f"--model {model}: no *.safetensors files, only config.json; add "
                         "--load-format dummy to run this shape with random weights")
    return str(path.resolve())


def check_quantization(model_dir: str, quantization: str | None) -> None:
    """The checkpoint's ``quantization_config`` (and ``--quantization``) is one we load.

    Raises:
        UsageError: an unsupported method or FP8 variant, or weights stored quantized
            (FP8, int8, packed int4) under a config that declares no quantization, in one
            line that names it and what is supported.
    """
    from elasticep.models.checkpoint import first_quantized_tensor
    from elasticep.models.quantization import UnsupportedQuantizationError, parse_quantization

    path = Path(model_dir) / "config.json"
    try:
        quant = parse_quantization(json.loads(path.read_text()), quantization,
                                   where=f"--model {model_dir}")
    except UnsupportedQuantizationError as exc:
        raise UsageError(str(exc)) from None
    if quant is None or quant.online:
        # weights stored quantized under a config that declares nothing would be read as
        # plain floats: refuse before any rank loads, not in a rank's traceback
        stored = first_quantized_tensor(model_dir)
        if stored is not None:
            raise UsageError(
                f"--model {model_dir}: tensor {stored[0]!r} is stored as {stored[1]}, but "
                "config.json declares no quantization_config; supported: block-scaled FP8 "
                "(quant_method fp8, weight_block_size [128, 128]) with its "
                "'<name>_scale_inv' scales, declared in config.json")


def check_model_config(model_dir: str) -> None:
    """``model_dir``'s config.json parses into a model config (every rank parses it: a
    bad field must stop the command, not each rank); call after
    :func:`check_quantization`, whose message names a bad ``quantization_config`` better.

    Raises:
        UsageError: the parse failed (transformers' field checks raise their own error
            types), in one line.
    """
    from elasticep.models.config import load_model_config

    try:
        load_model_config(model_dir)
    except Exception as exc:  # noqa: BLE001 - see Raises
        raise UsageError(f"--model {model_dir}: config.json: "
                         f"{' '.join(str(exc).split())}") from None


def has_weights(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a safetensors checkpoint (files or their index)."""
    return ((model_dir / "model.safetensors.index.json").is_file()
            or any(model_dir.glob("*.safetensors")))


def setup_logging() -> None:
    """A command's own logs go to stderr (serve's stdout carries only the ready line)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(levelname)s %(message)s")


LOG_DIR_HELP = "where worker logs go (default: a new temporary directory)"


def make_log_dir(value: str | None, prefix: str) -> Path:
    """The directory for worker logs: ``--log-dir`` (created if missing), else a new
    temporary directory named ``prefix...``.

    Raises:
        UsageError: ``--log-dir`` is empty, cannot be created or is not a writable directory
            (checked before anything starts: a failure later was reported as the
            coordinator's).
    """
    if value is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    if not value.strip():  # Path("") is the working directory
        raise UsageError("--log-dir must not be empty")
    path = Path(value).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {value}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--log-dir {value}: not writable")
    return path
