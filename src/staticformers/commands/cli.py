"""The `staticformers` command line: one subcommand per module in `staticformers.commands`.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`, and
is imported only when its subcommand runs, so `staticformers doctor` starts fast. A flag the subcommand
does not know is refused in that subcommand's usage, with its closest flags (`--max-new-token` ->
`--max-new-tokens`); every subcommand's `--help` shows the defaults.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from typing import Optional, Sequence

from .options import before_torch

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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, where it has one worth saying (not None, not a False switch, not
    one its help already states)."""

    def _get_help_string(self, action):
        if (
            action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
            or "default" in (action.help or "")
        ):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A parser whose unknown flags are refused by the subcommand they were given to, naming its closest flags."""

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._subcommand(getattr(ns, "command", None)) or self
            parser.error(unrecognized(parser, extras))
        return ns

    def _subcommand(self, name: Optional[str]) -> Optional[argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                return action.choices[name]
        return None


def unrecognized(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The message for arguments `parser` does not take: each unknown flag with its closest flags there."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extras:
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        scored = sorted(((difflib.SequenceMatcher(None, flag, o).ratio(), o) for o in options), reverse=True)
        close = [o for score, o in scored[:2] if score >= max(0.6, scored[0][0] - 0.1)] if scored else []
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)} (a flag of '{parser.prog}')?")
        else:
            hints.append(f"{flag} is not a flag of '{parser.prog}': see {parser.prog} --help")
    return f"unrecognized arguments: {' '.join(extras)}" + ("; " + "; ".join(hints) if hints else "")


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """The parser; `-v` is accepted before or after the subcommand, and no flag may be abbreviated (a
    `--max-new-token` typo is an error, not a silent `--max-new-tokens`)."""
    from .. import __version__

    parser = _Parser(
        prog="staticformers", description="Hugging Face causal LMs with a fixed shape plan.", allow_abbrev=False
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    parser.add_argument("--version", action="version", version=f"staticformers {__version__}")
    # after the subcommand too; SUPPRESS: when absent there it leaves the value set before the subcommand
    verbose = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in commands.items():
        p = sub.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            allow_abbrev=False,
            parents=[verbose],
            formatter_class=_HelpFormatter,
        )
        module.add_arguments(p)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    commands = _available_commands()
    args = build_parser(commands).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    before_torch(args)  # --threads, OpenMP's wait policy: read as torch loads, which no command has done yet
    try:
        return int(commands[args.command].run(args) or 0)
    except (ValueError, OSError, RuntimeError, TypeError, MemoryError) as err:  # OSError: files, Hub access
        # bad input: one sentence, no traceback (set -v for the log)
        print(f"staticformers {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
