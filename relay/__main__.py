"""``python -m relay``: the relay program (see :mod:`relay.entry`)."""

import sys

from .entry import main

if __name__ == "__main__":
    sys.exit(main())
