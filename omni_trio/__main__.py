"""``python -m omni_trio {demo}``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._demo import add_demo_arguments, run_demo


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m omni_trio", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="generate one image with a tiny model, no downloads")
    add_demo_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    parser.error(f"unknown command {args.command}")  # unreachable: argparse checks it


if __name__ == "__main__":
    sys.exit(main())
