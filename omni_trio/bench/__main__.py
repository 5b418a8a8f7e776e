"""``python -m omni_trio.bench {overhead,abort} [--quick] [--out DIR]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ._abort import run_abort
from ._common import machine, write_result
from ._overhead import run_overhead


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark and print its JSON."""
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench")
    parser.add_argument("name", choices=["overhead", "abort"])
    parser.add_argument("--quick", action="store_true", help="a few seconds, for smoke tests")
    parser.add_argument("--out", type=Path, default=None, help="folder for NAME.json")
    args = parser.parse_args(argv)
    # One torch thread: timings on 2-core machines are noise otherwise (pitfalls.md).
    torch.set_num_threads(1)
    if args.name == "overhead":
        result = run_overhead(
            steps=100 if args.quick else 1000,
            requests=2 if args.quick else 10,
            repeats=2 if args.quick else 5,
            step_seconds=0.0,
        )
    else:
        result = run_abort(aborts=5 if args.quick else 100, step_seconds=0.01)
    result["machine"] = machine()
    write_result(args.name, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
