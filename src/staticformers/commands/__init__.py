"""The `staticformers` command line: cli.py and one module per subcommand (doctor, generate, compile, train, serve).

Each command module defines `HELP`, `add_arguments(parser)` and `run(args) -> int` and is imported only
when its subcommand runs.

May import: every layer (the top one).
"""
