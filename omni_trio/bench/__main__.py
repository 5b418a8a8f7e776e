"""``python -m omni_trio.bench NAME [--quick] [--out DIR]``.

overhead   the engine's cost per step over the runner's bare loop (FakeRunner)
abort      abort call to release, for running and waiting requests (FakeRunner)
pipeline   the engine vs a tiny diffusers pipeline's own call
batching   a burst of compatible requests at max_batch_size 1, 4, 8
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ._abort import run_abort
from ._common import machine, write_result
from ._overhead import run_overhead
from ._pipeline import run_batching, run_pipeline

NAMES = ("overhead", "abort", "pipeline", "batching")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    if args.name == "overhead":
        return run_overhead(
            steps=100 if quick else 1000,
            requests=2 if quick else 10,
            repeats=2 if quick else 5,
            step_seconds=0.0,
        )
    if args.name == "abort":
        return run_abort(aborts=5 if quick else 100, step_seconds=0.01)
    if args.name == "pipeline":
        return run_pipeline(
            kind=args.kind,
            steps=4 if quick else 20,
            size=64,
            repeats=2 if quick else 5,
            device=args.device,
        )
    return run_batching(
        kind=args.kind,
        requests=4 if quick else args.requests,
        batches=[1, 4] if quick else [1, 4, 8],
        steps=3 if quick else 10,
        size=64,
        repeats=1 if quick else 3,
        device=args.device,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark and print its JSON."""
    parser = argparse.ArgumentParser(prog="python -m omni_trio.bench", description=__doc__)
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--quick", action="store_true", help="a few seconds, for smoke tests")
    parser.add_argument("--out", type=Path, default=None, help="folder for NAME.json")
    parser.add_argument("--kind", default="sd", help="tiny pipeline kind (pipeline, batching)")
    parser.add_argument("--device", default="cpu", help="torch device (pipeline, batching)")
    parser.add_argument("--requests", type=int, default=16, help="burst size (batching)")
    args = parser.parse_args(argv)
    # One torch thread: timings on 2-core machines are noise otherwise (pitfalls.md).
    torch.set_num_threads(1)
    result = _run(args)
    result["machine"] = machine()
    write_result(args.name, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
