"""`elasticep` command line: one subcommand per module, registered lazily.

Each subcommand module exposes ``add_parser(subparsers)`` and ``run(args) -> int`` and
imports what it needs at its top; this dispatcher is the only place that imports lazily
(by module name), so nothing below the commands ever imports the HTTP stack.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every subcommand that is importable."""
    parser = argparse.ArgumentParser(
        prog="elasticep",
        description="Fault-tolerant elastic expert-parallel inference for MoE models.",
    )
    parser.add_argument("--version", action="version",
                        version=f"elasticep {elasticep.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=_SubcommandParser)
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
