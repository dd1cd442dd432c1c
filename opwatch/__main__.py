"""``python -m opwatch``: the command line, whose code is :mod:`opwatch.runners.cli`."""

import sys

from .runners.cli import main

if __name__ == "__main__":
    sys.exit(main())
