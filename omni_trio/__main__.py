"""``python -m omni_trio``: the ``omni-trio`` command line, which lives in ``omni_trio.cli``."""

from __future__ import annotations

import sys

from .cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
