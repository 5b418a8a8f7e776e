"""``python -m benchmarks NAME [--quick] [--out DIR] [--docs]``, from the repository root.

overhead    sequential requests, engine vs the runner's bare loop (tiny SD; FakeRunner)
abort       abort call to release, running and waiting, vs naive and interrupt (tiny SD)
post-abort  request B's latency after request A was aborted (tiny SD, 64 and 128 px; tiny Wan video)
substep     an abort inside a ~1 s step, cancel points vs the step's end; hook cost (tiny Wan, SD)
leak        live tensors and RSS after requests ending every way (tiny SD)
batching    a burst of compatible requests at max_batch_size 1, 4, 8 (tiny SD)
join        a short request's wait to join a running batch (tiny SD)
devices     throughput with 1, 2 and 4 workers sharing one queue (FakeRunner; tiny SD)
priority    an urgent request behind background batches: FIFO, priorities, preemption
scale       admission and abort cost with 10 to 10,000 waiting (GatedRunner)
preview     step time with previews read vs off (tiny SD)
pipeline    one request at a time, engine vs the pipeline's own call
serve       open-loop HTTP load with impatient clients, omni-trio serve vs naive
deadline    goodput under a 2x overload, with deadlines vs FIFO (FakeRunner)
jobs        a video job's checkpoints: cost per step, restart to resume, steps redone (tiny Wan)
fairness    a heavy tenant flooding beside a light one: fair share vs FIFO; admission cost
cache       step caching: block work, wall time, PSNR, batch invariance; diffusers' hook (tiny DiTs)
ranks       one request over two ranks: CFG split, Ulysses, ring vs one rank (tiny SD, Flux)
adapters    four LoRAs in one batch vs set_adapters one after another; load, unload (tiny Flux)
reuse       a trace with repeats, prompt and result caches on vs off (tiny SD, SDXL, Flux)
rollouts    RL groups with the SDE sampler vs a pipeline call per group; log-prob mismatch
fastpath    bf16, compiled, int8 steps, engine vs the pipeline call; starts, recompiles (Flux, SD)
cluster     two servers on PostgreSQL + S3 vs one on SQLite: takeovers, SIGKILLs, URLs (tiny Wan)
ray         a Ray Serve replica vs plain serve: cost per request, disconnect aborts
all         every benchmark above, in this order

Each benchmark writes NAME.json (with a "summary" of headline figures), NAME.md
and NAME.png into --out (printing only the JSON of a single benchmark without
it). --docs writes them into docs/perf/ (unless --out is given) and regenerates
docs/performance.md from every NAME.json there; without --docs, docs are never
touched. --from-json measures nothing: it rewrites NAME.md and NAME.png (and,
with --docs, the page) from the NAME.json already there. --quick takes seconds
per benchmark, for smoke tests: its figures are not worth quoting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .common import Options
from .docs import default_docs_dir, write_docs
from .suite import BENCHMARKS, COMMAND, rerender, run_benchmark

NAMES = (*BENCHMARKS, "all")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark, or all; write their files; regenerate the docs with --docs."""
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--quick", action="store_true", help="seconds each, for smoke tests")
    parser.add_argument("--out", type=Path, default=None, help="folder for NAME.json/.md/.png")
    parser.add_argument(
        "--docs",
        action="store_true",
        help="also regenerate docs/performance.md (default out: docs/perf)",
    )
    parser.add_argument("--kind", default="sd", help="tiny pipeline kind (pipeline, batching)")
    parser.add_argument(
        "--device", default="cpu", help="torch device (pipeline, batching, adapters, fastpath)"
    )
    parser.add_argument("--requests", type=int, default=16, help="burst size (batching)")
    parser.add_argument("--backend", default="trio", choices=("trio", "asyncio"))
    parser.add_argument(
        "--from-json",
        action="store_true",
        help="measure nothing: rewrite NAME.md and NAME.png (and the docs) from NAME.json",
    )
    args = parser.parse_args(argv)
    out: Path | None = args.out
    docs = default_docs_dir()
    if args.docs:
        if not docs.is_dir():
            parser.error(f"--docs: no docs folder at {docs} (run from a source checkout)")
        out = out if out is not None else docs / "perf"
    options = Options(
        quick=args.quick,
        kind=args.kind,
        device=args.device,
        requests=args.requests,
        backend=args.backend,
    )
    # One torch thread: on a 2-core machine torch's own thread pool competes with the
    # engine's threads, and the timings are noise otherwise.
    torch.set_num_threads(1)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    started = time.perf_counter()
    for name in names:
        if args.from_json:
            if out is None:
                parser.error("--from-json needs --out or --docs")
            rerender(BENCHMARKS[name], out)
            continue
        result = run_benchmark(BENCHMARKS[name], options, out)
        if len(names) == 1:
            print(json.dumps(result, indent=2, sort_keys=True))
    print(f"{args.name}: {time.perf_counter() - started:.1f} s in all", file=sys.stderr)
    if args.docs:
        assert out is not None
        print(f"wrote {write_docs(out, docs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
