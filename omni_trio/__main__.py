"""``python -m omni_trio {demo,serve}``."""

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
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP (OpenAI images API), drain on SIGTERM"
    )
    try:
        from .serve._cli import add_serve_arguments, run_serve
    except ImportError as exc:  # the "serve" extra (starlette, hypercorn, ...) is missing
        missing = exc
        serve.set_defaults(serve_missing=missing)
    else:
        add_serve_arguments(serve)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(args)
    if args.command == "serve":
        if getattr(args, "serve_missing", None) is not None:
            parser.error(
                f"serve needs the 'serve' extra: pip install 'omni_trio[serve]' ({missing})"
            )
        return run_serve(args)
    parser.error(f"unknown command {args.command}")  # unreachable: argparse checks it


if __name__ == "__main__":
    sys.exit(main())
