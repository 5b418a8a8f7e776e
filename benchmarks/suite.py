"""The benchmarks by name, and what running one writes: NAME.json, NAME.md, NAME.png."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .abort import plot_abort, run_abort, table_abort
from .adapters import plot_adapters, run_adapters, table_adapters
from .cache import plot_cache, run_cache, table_cache
from .cluster import plot_cluster, run_cluster, table_cluster
from .common import Options, machine
from .deadline import plot_deadline, run_deadline, table_deadline
from .devices import plot_devices, run_devices, table_devices
from .fairness import plot_fairness, run_fairness, table_fairness
from .fastpath import plot_fastpath, run_fastpath, table_fastpath
from .jobs import plot_jobs, run_jobs, table_jobs
from .join import plot_join, run_join, table_join
from .leak import plot_leak, run_leak, table_leak
from .overhead import plot_overhead, run_overhead, table_overhead
from .pipeline import (
    plot_batching,
    plot_pipeline,
    run_batching,
    run_pipeline,
    table_batching,
    table_pipeline,
)
from .plot import save_plot
from .postabort import plot_post_abort, run_post_abort, table_post_abort
from .preview import plot_preview, run_preview, table_preview
from .priority import plot_priority, run_priority, table_priority
from .ranks import plot_ranks, run_ranks, table_ranks
from .ray_bench import plot_ray, run_ray, table_ray
from .reuse import plot_reuse, run_reuse, table_reuse
from .rollouts import plot_rollouts, run_rollouts, table_rollouts
from .scale import plot_scale, run_scale, table_scale
from .serve import plot_serve, run_serve, table_serve
from .substep import plot_substep, run_substep, table_substep
from .targets import targets_for

__all__ = [
    "BENCHMARKS",
    "COMMAND",
    "Benchmark",
    "render_markdown",
    "rerender",
    "run_benchmark",
]

#: How the benchmarks are run, from the repository root; results record it.
COMMAND = "python -m benchmarks"


@dataclass(frozen=True, slots=True, kw_only=True)
class Benchmark:
    """One benchmark: how to run it, tabulate it and plot it."""

    name: str
    what: str
    run: Callable[[Options], dict[str, Any]]
    table: Callable[[dict[str, Any]], str]
    plot: Callable[[dict[str, Any], Path], None]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            name="overhead",
            what="sequential requests through the engine vs the runner's bare loop",
            run=run_overhead,
            table=table_overhead,
            plot=plot_overhead,
        ),
        Benchmark(
            name="abort",
            what="from the abort call to the worker's release, running and waiting requests",
            run=run_abort,
            table=table_abort,
            plot=plot_abort,
        ),
        Benchmark(
            name="post-abort",
            what=(
                "the latency of request B after request A was aborted, per peer and size;"
                " a video's device work after its abort, cancel points vs none"
            ),
            run=run_post_abort,
            table=table_post_abort,
            plot=plot_post_abort,
        ),
        Benchmark(
            name="substep",
            what="an abort inside a long step: left at the next block (L71) vs at the step's end",
            run=run_substep,
            table=table_substep,
            plot=plot_substep,
        ),
        Benchmark(
            name="leak",
            what="live tensors, objects and RSS after requests that end every way there is",
            run=run_leak,
            table=table_leak,
            plot=plot_leak,
        ),
        Benchmark(
            name="batching",
            what="a burst of compatible requests at max_batch_size 1, 4, 8",
            run=run_batching,
            table=table_batching,
            plot=plot_batching,
        ),
        Benchmark(
            name="join",
            what="a short request arriving during a long batch: its wait to join",
            run=run_join,
            table=table_join,
            plot=plot_join,
        ),
        Benchmark(
            name="devices",
            what="throughput with 1, 2 and 4 workers sharing one queue",
            run=run_devices,
            table=table_devices,
            plot=plot_devices,
        ),
        Benchmark(
            name="priority",
            what="an urgent request behind background batches: FIFO, priorities, preemption",
            run=run_priority,
            table=table_priority,
            plot=plot_priority,
        ),
        Benchmark(
            name="scale",
            what="admission and abort cost per request with 10 to 10,000 waiting",
            run=run_scale,
            table=table_scale,
            plot=plot_scale,
        ),
        Benchmark(
            name="preview",
            what="step time with a preview on every step, read, vs previews off",
            run=run_preview,
            table=table_preview,
            plot=plot_preview,
        ),
        Benchmark(
            name="pipeline",
            what="one request at a time, the engine vs the pipeline's own call",
            run=run_pipeline,
            table=table_pipeline,
            plot=plot_pipeline,
        ),
        Benchmark(
            name="serve",
            what="open-loop HTTP load with impatient clients, omni-trio serve vs a naive server",
            run=run_serve,
            table=table_serve,
            plot=plot_serve,
        ),
        Benchmark(
            name="deadline",
            what="goodput under a 2x overload, with deadlines vs FIFO (FakeRunner)",
            run=run_deadline,
            table=table_deadline,
            plot=plot_deadline,
        ),
        Benchmark(
            name="jobs",
            what="checkpoints of a running video job: cost per step, restart to resume,"
            " steps redone after a crash",
            run=run_jobs,
            table=table_jobs,
            plot=plot_jobs,
        ),
        Benchmark(
            name="fairness",
            what=(
                "a heavy tenant flooding beside a light one: fair share vs FIFO"
                " (the policy on a virtual clock); the cost of admission with 100 tenants"
            ),
            run=run_fairness,
            table=table_fairness,
            plot=plot_fairness,
        ),
        Benchmark(
            name="cache",
            what=(
                "per-request step caching: block work, wall time and PSNR vs uncached, skip"
                " decisions alone vs in a churning batch, diffusers' first-block cache beside it"
            ),
            run=run_cache,
            table=table_cache,
            plot=plot_cache,
        ),
        Benchmark(
            name="ranks",
            what="one request over two ranks (CFG split, Ulysses, ring) vs one rank",
            run=run_ranks,
            table=table_ranks,
            plot=plot_ranks,
        ),
        Benchmark(
            name="adapters",
            what=(
                "four requests with four different LoRAs in one batch vs one after another"
                " with set_adapters, vs no adapter; load and unload times"
            ),
            run=run_adapters,
            table=table_adapters,
            plot=plot_adapters,
        ),
        Benchmark(
            name="reuse",
            what=(
                "a trace with repeats (a Zipf mix of prompts, exact repeats, two tenants):"
                " the prompt-embedding and result caches on vs off"
            ),
            run=run_reuse,
            table=table_reuse,
            plot=plot_reuse,
        ),
        Benchmark(
            name="rollouts",
            what=(
                "RL rollouts with the SDE sampler, 8 prompts x 8 samples: generate_group vs a"
                " pipeline call per group; the trainer's log-probability mismatch; weight"
                " updates, sleep and wake"
            ),
            run=run_rollouts,
            table=table_rollouts,
            plot=plot_rollouts,
        ),
        Benchmark(
            name="fastpath",
            what=(
                "a step in bf16, compiled and quantized, the engine vs the pipeline's own call"
                " with the same settings; cold and warm starts, recompiles after the warm-up"
            ),
            run=run_fastpath,
            table=table_fastpath,
            plot=plot_fastpath,
        ),
        Benchmark(
            name="cluster",
            what=(
                "two servers on one PostgreSQL and one S3 bucket vs one on SQLite: create to"
                " first step, takeover after a SIGKILL, 20 random SIGKILLs; URL vs base64"
            ),
            run=run_cluster,
            table=table_cluster,
            plot=plot_cluster,
        ),
        Benchmark(
            name="ray",
            what="a Ray Serve replica vs plain omni-trio serve: cost per request, disconnects",
            run=run_ray,
            table=table_ray,
            plot=plot_ray,
        ),
    )
}


def _command(name: str, options: Options) -> str:
    parts = [COMMAND, name]
    if options.quick:
        parts.append("--quick")
    if options.backend != "trio":
        parts.append(f"--backend {options.backend}")
    if name in ("pipeline", "batching"):
        if options.kind != "sd":
            parts.append(f"--kind {options.kind}")
        if options.device != "cpu":
            parts.append(f"--device {options.device}")
        if name == "batching" and options.requests != 16 and not options.quick:
            parts.append(f"--requests {options.requests}")
    return " ".join(parts)


def render_markdown(bench: Benchmark, result: dict[str, Any]) -> str:
    """NAME.md: the headline figures against their targets, then the benchmark's table."""
    lines = [f"# {bench.name}: {bench.what}", "", f"`{result['command']}` ({result['date']})", ""]
    for target in targets_for(bench.name):
        verdict = "met" if target.met(result) else "**missed**"
        lines.append(
            f"- {target.label}: {target.figure(result)} (target {target.target}): {verdict}"
        )
    lines.append("")
    return "\n".join(lines) + "\n" + bench.table(result)


def run_benchmark(bench: Benchmark, options: Options, out: Path | None) -> dict[str, Any]:
    """Run ``bench``; write NAME.json, NAME.md and NAME.png into ``out`` when given."""
    started = time.perf_counter()
    load_before = machine()["load_average"]
    cpus = os.cpu_count() or 1
    # The benchmark itself keeps about one CPU busy; more than that is other work.
    if load_before and load_before[0] > max(1.0, cpus / 2) + 0.5:
        print(
            f"{bench.name}: the machine is busy (load average {load_before[0]:.1f} on {cpus}"
            " CPUs): figures will be noisy",
            file=sys.stderr,
        )
    result = bench.run(options)
    result["machine"] = machine()
    result["machine"]["load_average_before"] = load_before
    result["elapsed_s"] = time.perf_counter() - started
    result["date"] = time.strftime("%Y-%m-%d")
    result["command"] = _command(bench.name, options)
    result["quick"] = options.quick
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(result, indent=2, sort_keys=True)
        (out / f"{bench.name}.json").write_text(text + "\n")
        _write_views(bench, result, out)
    print(
        f"{bench.name}: {result['elapsed_s']:.1f} s; summary {json.dumps(result['summary'])}",
        file=sys.stderr,
    )
    return result


def _write_views(bench: Benchmark, result: dict[str, Any], out: Path) -> None:
    (out / f"{bench.name}.md").write_text(render_markdown(bench, result))
    save_plot(bench.plot, result, out / f"{bench.name}.png")


def rerender(bench: Benchmark, out: Path) -> dict[str, Any]:
    """Write NAME.md and NAME.png again from ``out/NAME.json``, measuring nothing."""
    result: dict[str, Any] = json.loads((out / f"{bench.name}.json").read_text())
    _write_views(bench, result, out)
    return result
