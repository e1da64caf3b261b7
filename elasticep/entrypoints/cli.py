"""`elasticep` command line: one subcommand per module, registered lazily.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and
imports what it needs at its top; this dispatcher is the only place that imports lazily
(by module name), so nothing below the commands ever imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import traceback
from typing import NoReturn

import elasticep

# subcommand name -> module implementing add_parser()/run()
SUBCOMMANDS = {
    "generate": "elasticep.entrypoints.generate_cmd",
    "serve": "elasticep.entrypoints.serve_cmd",
    "join": "elasticep.entrypoints.join_cmd",
}


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser that refuses unknown flags itself, so the error comes with
    that subcommand's usage (argparse hands them up to the top-level parser otherwise)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand that is importable, or with the
    subcommand ``only`` alone (its process then imports no other subcommand's module:
    ``generate``'s imports torch, which ``join`` needs not)."""
    parser = argparse.ArgumentParser(
        prog="elasticep",
        description="Fault-tolerant elastic expert-parallel inference for MoE models.",
    )
    parser.add_argument("--version", action="version",
                        version=f"elasticep {elasticep.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=_SubcommandParser)
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `elasticep` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    # a subcommand named first is the only one parsed: build only its parser
    parser = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = importlib.import_module(SUBCOMMANDS[args.command])
    return int(mod.run(args) or 0)


def console_main() -> NoReturn:
    """Entry of the `elasticep` console script and of ``python -m
    elasticep.entrypoints.cli``: run :func:`main`, flush the logs and stdio, and end the
    process at once with the command's status (``os._exit``).

    Why not a normal interpreter exit: the command has stopped what it started by then,
    but a daemon thread may still be inside native code with the GIL released (a
    torch.distributed store call did this in serve's launcher threads). When it returns
    during interpreter finalization, CPython ends that thread by unwinding its C++
    frames, and a ``noexcept`` frame on the way calls ``std::terminate``: "terminate
    called without an active exception" and SIGABRT instead of the command's own status
    (issue 17, item 9). C++ static destructors that meet a still-joinable
    ``std::thread`` end the same way; ``os._exit`` runs neither.
    """
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        code = _exit_code(exc.code)
    except KeyboardInterrupt:  # Ctrl-C before a command installed its handlers
        code = 130
    except BaseException:  # noqa: BLE001 - a bug: report it as Python would, then exit 1
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe
            stream.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    """The process status ``sys.exit(code)`` would give (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    console_main()
