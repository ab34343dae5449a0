"""`python -m staticformers ...` (what `torchrun -m staticformers serve ...` runs): the command line."""

import sys

from .commands.cli import main

sys.exit(main())
