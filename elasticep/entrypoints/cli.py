"""`elasticep` command line: one subcommand per module, registered lazily.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and
imports what it needs at its top; this dispatcher is the only place that imports lazily
(by module name), so nothing below the commands ever imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module implementing add_parser()/run()
SUBCOMMANDS = {
    "generate": "elasticep.entrypoints.generate_cmd",
    "serve": "elasticep.entrypoints.serve_cmd",
    "join": "elasticep.entrypoints.join_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand that is importable."""
    parser = argparse.ArgumentParser(
        prog="elasticep",
        description="Fault-tolerant elastic expert-parallel inference for MoE models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    mod = importlib.import_module(SUBCOMMANDS[args.command])
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
