"""The `staticformers` command line: one subcommand per module in `staticformers.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`, and
is imported only when its subcommand runs, so `staticformers doctor` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Optional, Sequence

COMMANDS = {
    "doctor": "staticformers.commands.doctor",
    "generate": "staticformers.commands.generate",
    "compile": "staticformers.commands.compile",
    "train": "staticformers.commands.train",
    "serve": "staticformers.commands.serve",
}


def _available_commands() -> dict:
    out = {}
    for name, module in COMMANDS.items():
        try:
            out[name] = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return out


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """The parser; `-v` is accepted before or after the subcommand, and no flag may be abbreviated (a
    `--max-new-token` typo is an error, not a silent `--max-new-tokens`)."""
    parser = argparse.ArgumentParser(prog="staticformers", description="Hugging Face causal LMs with a fixed shape plan.",
                                     allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    # after the subcommand too; SUPPRESS: when absent there it leaves the value set before the subcommand
    verbose = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in commands.items():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False, parents=[verbose])
        module.add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    commands = _available_commands()
    args = build_parser(commands).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return int(commands[args.command].run(args) or 0)
    except (ValueError, OSError, RuntimeError, TypeError, MemoryError) as err:  # OSError: files, Hub access
        # bad input: one sentence, no traceback (set -v for the log)
        print(f"staticformers {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
