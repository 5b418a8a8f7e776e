"""``ranks``: one request over two ranks (CFG split, Ulysses, ring) against one rank.

For each layout, on two gloo ranks of one torch thread each (``ParallelRunner``):

- step time: one denoise step of one request, the runner called directly, against
  ``DiffusersRunner`` in one process with one torch thread and with two (the same
  two cores the ranks share); medians of interleaved repeats;
- the seeds' table, through the engine: request B alone (baseline), then request A
  aborted at a random moment (a seeded fraction of B's baseline; the abort lands
  at a step boundary or, agreed by the ranks, inside a step), then B again
  (post-abort). The overhead is the median of each repeat's post-abort over its
  own baseline; B *recovered* when its image is bitwise its baseline image (same
  batch: alone);
- step caching (Ulysses, ring): one request's denoise time with and without a
  first-block cache, on the two ranks and on one process of one thread, interleaved;
  the speed-up on each, and the calls each skipped (the same: the ranks decide from
  their summed ratios, as one process does);
- plan delivery: from rank 0's send of a plan to the other rank's read of it
  (the machine's monotonic clock, the same in both processes), p50 and p99, from
  the runner's ``report()``; and what a cancel point's agreed check costs when
  nothing stops (a read of the shared flag), per call.

Configurations (compute-bound where the tiny models allow): the split on tiny SD at
256 px (its convolutions dominate a step), Ulysses and ring on tiny Flux at 512 px
(1,024 image tokens and 512 text tokens; the model is two blocks of width 32, so the
exchanges weigh more than they would on a real DiT). ``--quick``: 64 px, 3 steps, 2
aborts.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from omni_trio import GenerationRequest, StepCache, open_engine
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_pipeline

from .common import Options, fmt, md_table, p99, shared_pipeline, spread
from .plot import figure
from .ranks_by_load import Lent, run_by_load

__all__ = ["plot_ranks", "run_ranks", "table_ranks"]

#: Each layout's model and, full and quick, its size.
LAYOUTS = {"cfg": "sd", "ulysses": "flux", "ring": "flux"}
SIZES = {"sd": 256, "flux": 512}
#: The step cache the token splits are timed with: first-block at a threshold that the
#: tiny model's change ratios (0.2-0.5 per step) cross, so some calls skip.
CACHE = StepCache(kind="first-block", threshold=0.4)


def _request(kind: str, size: int, steps: int, seed: int) -> GenerationRequest:
    return GenerationRequest(
        prompt="a lighthouse at dusk",
        num_steps=steps,
        height=size,
        width=size,
        guidance_scale=5.0,
        seed=seed,
    )


def _step_s(runner: Any, request: GenerationRequest, steps: int) -> list[float]:
    """Each step's time for ``request`` on ``runner``, called directly."""
    state = runner.prepare(request, "timed")
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            runner.step([state])
            times.append(time.perf_counter() - started)
    finally:
        runner.discard(state)
    return times


def _step_times(
    runner: ParallelRunner, kind: str, request: GenerationRequest, repeats: int
) -> dict[str, list[float]]:
    """Interleaved per-step times: two ranks, one process of 1 thread, of 2 threads."""
    single = DiffusersRunner(shared_pipeline(kind))
    times: dict[str, list[float]] = {"ranks": [], "one_thread": [], "two_threads": []}
    for _ in range(repeats):
        torch.set_num_threads(1)
        times["ranks"] += _step_s(runner, request, request.num_steps)[1:]
        times["one_thread"] += _step_s(single, request, request.num_steps)[1:]
        torch.set_num_threads(2)
        times["two_threads"] += _step_s(single, request, request.num_steps)[1:]
    torch.set_num_threads(1)  # the ranks' count, which every rank follows
    single.close()
    return times


def _request_s(runner: Any, request: GenerationRequest) -> tuple[float, int]:
    """One request's denoise time on ``runner`` called directly, and the calls its cache
    skipped (0 without one)."""
    state = runner.prepare(request, "cached")
    try:
        started = time.perf_counter()
        for _ in range(request.num_steps):
            runner.step([state])
        elapsed = time.perf_counter() - started
        metrics = runner.cache_metrics(state)
        return elapsed, 0 if metrics is None else metrics.calls_skipped
    finally:
        runner.discard(state)


def _cache_times(
    runner: ParallelRunner, kind: str, request: GenerationRequest, repeats: int
) -> dict[str, Any]:
    """Interleaved request times with and without ``CACHE``: two ranks, one process of one
    thread; each one's speed-up and the calls it skipped."""
    cached = dataclasses.replace(request, cache=CACHE)
    single = DiffusersRunner(shared_pipeline(kind))
    arms = {
        "ranks": (runner, request),
        "ranks_cached": (runner, cached),
        "one_thread": (single, request),
        "one_thread_cached": (single, cached),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    skipped: dict[str, int] = {}
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for name, (each, r) in arms.items():
                elapsed, skipped[name] = _request_s(each, r)
                times[name].append(elapsed)
    finally:
        single.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "threshold": CACHE.threshold,
        "request_ms": {name: spread([v * 1e3 for v in values]) for name, values in times.items()},
        "calls": request.num_steps,
        "calls_skipped": {
            "ranks": skipped["ranks_cached"],
            "one_thread": skipped["one_thread_cached"],
        },
        "speedup_ranks": medians["ranks"] / medians["ranks_cached"],
        "speedup_one_thread": medians["one_thread"] / medians["one_thread_cached"],
    }


async def _seeds_table(
    runner: ParallelRunner, request: GenerationRequest, aborts: int, seed: int
) -> dict[str, Any]:
    """Baseline, post-abort and recovery of B around ``aborts`` random aborts of A."""
    rng = random.Random(seed)
    victim = GenerationRequest(
        prompt="a storm over the sea",
        num_steps=request.num_steps,
        height=request.height,
        width=request.width,
        guidance_scale=request.guidance_scale,
        seed=seed + 1,
    )
    rows: list[dict[str, float]] = []
    async with open_engine(Lent(runner)) as engine:
        reference = (await engine.generate(request)).images  # and a warm-up
        for _ in range(aborts):
            started = time.perf_counter()
            await engine.generate(request)
            baseline = time.perf_counter() - started
            async with engine.submit(victim) as handle:
                await anyio.sleep(rng.uniform(0.1, 0.9) * baseline)
                await handle.abort()
            started = time.perf_counter()
            images = (await engine.generate(request)).images
            post = time.perf_counter() - started
            rows.append(
                {
                    "baseline_s": baseline,
                    "post_abort_s": post,
                    "recovered": float(torch.equal(images, reference)),
                }
            )
        report = await anyio.to_thread.run_sync(runner.report)
    delivery = [s for rank in report[1:] for s in rank.plan_delivery_s]
    return {
        "baseline_s": spread([r["baseline_s"] for r in rows]),
        "post_abort_s": spread([r["post_abort_s"] for r in rows]),
        "overhead_pct": statistics.median(
            (r["post_abort_s"] / r["baseline_s"] - 1) * 100 for r in rows
        ),
        "recovered": sum(r["recovered"] for r in rows),
        "aborts": aborts,
        "plan_delivery_us": {
            "p50": statistics.median(delivery) * 1e6,
            "p99": p99(delivery) * 1e6,
            "n": len(delivery),
        },
        "states_left": sum(len(rank.states) for rank in report),
    }


def _check_ns() -> float:
    """One agreed cancel-point check that does not fire (a shared-flag read), in ns."""
    import multiprocessing

    from omni_trio.parallel._agree import agreed_check, new_flags

    flags = new_flags(multiprocessing.get_context("spawn"))
    check = agreed_check("announced", flags, 7, writer=False, engine=None)
    calls = 200_000
    started = time.perf_counter()
    for _ in range(calls):
        check()
    return (time.perf_counter() - started) / calls * 1e9


def _layout(layout: str, options: Options) -> dict[str, Any]:
    kind = LAYOUTS[layout]
    size = 64 if options.quick else SIZES[kind]
    steps, aborts, repeats = (3, 2, 1) if options.quick else (10, 5, 3)
    threads = torch.get_num_threads()
    runner = ParallelRunner(
        functools.partial(tiny_pipeline, kind),
        cfg=2 if layout == "cfg" else 1,
        ulysses=2 if layout == "ulysses" else 1,
        ring=2 if layout == "ring" else 1,
        torch_threads=1,
    )
    try:
        request = _request(kind, size, steps, seed=5)
        times = _step_times(runner, kind, request, repeats)
        # Three times the step repeats: a whole request varies more than a step does.
        cache = None if layout == "cfg" else _cache_times(runner, kind, request, 3 * repeats)
        table = options.run(_seeds_table, runner, request, aborts, 25)
    finally:
        runner.close()
        torch.set_num_threads(threads)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "layout": layout,
        "model": f"tiny {kind}",
        "size": size,
        "steps": steps,
        "step_ms": {name: spread([v * 1e3 for v in values]) for name, values in times.items()},
        "step_ratio_over_one_thread": medians["ranks"] / medians["one_thread"],
        "step_ratio_over_two_threads": medians["ranks"] / medians["two_threads"],
        "cache": cache,
        **table,
    }


def run_ranks(options: Options) -> dict[str, Any]:
    """Every layout in turn (each starts its own group), the check's cost, then the
    split by load's regimes."""
    rows = [_layout(layout, options) for layout in LAYOUTS]
    by_load = run_by_load(options)
    summary: dict[str, float] = {
        "post_abort_overhead_pct": max(r["overhead_pct"] for r in rows),
        "recovered": min(r["recovered"] for r in rows),
        "aborts": min(r["aborts"] for r in rows),
        "plan_delivery_us_p50": max(r["plan_delivery_us"]["p50"] for r in rows),
        "plan_delivery_us_p99": max(r["plan_delivery_us"]["p99"] for r in rows),
        "cancel_check_ns": _check_ns(),
        "states_left": sum(r["states_left"] for r in rows),
    }
    for r in rows:
        name = r["layout"]
        summary[f"{name}_step_ratio_over_one_thread"] = r["step_ratio_over_one_thread"]
        summary[f"{name}_step_ratio_over_two_threads"] = r["step_ratio_over_two_threads"]
        summary[f"{name}_post_abort_overhead_pct"] = r["overhead_pct"]
        summary[f"{name}_recovered"] = r["recovered"]
        if r["cache"] is not None:
            summary[f"{name}_cache_speedup"] = r["cache"]["speedup_ranks"]
            summary[f"{name}_cache_speedup_one_thread"] = r["cache"]["speedup_one_thread"]
    for key in ("alone", "deep"):
        for peer in ("tokens", "one_rank"):
            summary[f"by_load_{key}_ratio_over_{peer}"] = by_load[f"{key}_ratio_over_{peer}"]
    return {
        "config": {
            "ranks": 2,
            "torch_threads_per_rank": 1,
            "backend": options.backend,
            "layouts": {r["layout"]: f"{r['model']}, {r['size']} px" for r in rows},
        },
        "layouts": rows,
        "by_load": by_load,
        "summary": summary,
    }


_LABELS = {"cfg": "CFG split", "ulysses": "Ulysses", "ring": "ring"}


def table_ranks(result: dict[str, Any]) -> str:
    """The layouts' table, then the split by load's."""
    steps = result["layouts"][0]["steps"]
    head = (
        f"Two gloo ranks of one torch thread each on this machine's cores; requests of"
        f" {steps} steps; step times are medians over interleaved repeats (ms). Post-abort:"
        " B after A was aborted at a random moment, median of each repeat's ratio to its own"
        " baseline; recovered: B's image bitwise its baseline's. Plan delivery: rank 0's"
        f" send to the other rank's read, p50 / p99 µs. An agreed cancel-point check costs"
        f" {result['summary']['cancel_check_ns']:.0f} ns when nothing stops.\n\n"
    )
    return (
        head
        + _layouts_table(result)
        + "\n\n"
        + _cache_table(result)
        + "\n\n"
        + _by_load_table(result["by_load"])
    )


def _cache_table(result: dict[str, Any]) -> str:
    """Step caching on the token splits: request ms with and without, speed-ups, skips."""
    rows = []
    cached = [r for r in result["layouts"] if r.get("cache") is not None]
    for r in cached:
        cache = r["cache"]
        ms = cache["request_ms"]
        rows.append(
            [
                f"{_LABELS[r['layout']]}, {r['model']} {r['size']} px",
                fmt(ms["ranks"]["median"], 0),
                fmt(ms["ranks_cached"]["median"], 0),
                f"{cache['speedup_ranks']:.2f}x",
                fmt(ms["one_thread"]["median"], 0),
                fmt(ms["one_thread_cached"]["median"], 0),
                f"{cache['speedup_one_thread']:.2f}x",
                f"{cache['calls_skipped']['ranks']} / {cache['calls_skipped']['one_thread']}"
                f" of {cache['calls']}",
            ]
        )
    if not rows:
        return ""
    head = (
        f"Step caching on the token splits: one request, first-block at threshold"
        f" {cached[0]['cache']['threshold']:g}, the runner called directly (medians of"
        " interleaved repeats, ms); the ranks decide from their summed change ratios, so they"
        " skip the calls one process skips.\n\n"
    )
    return head + md_table(
        [
            "layout",
            "2 ranks",
            "2 ranks, cached",
            "speed-up",
            "1 rank, 1 thread",
            "cached",
            "speed-up",
            "calls skipped: 2 ranks / 1 rank",
        ],
        rows,
    )


_ARM_LABELS = {
    "by_load": "2 ranks, Ulysses split by load",
    "tokens": "2 ranks, Ulysses always",
    "one_rank": "1 rank, 2 threads",
}


def _by_load_table(by_load: dict[str, Any]) -> str:
    """arm | alone ms | deep requests/s | model calls each way."""
    rows = []
    for arm, label in _ARM_LABELS.items():
        figures = by_load["arms"][arm]
        calls = figures.get("calls")
        rows.append(
            [
                label,
                fmt(figures["alone_s"]["median"] * 1e3, 0),
                fmt(figures["deep_per_s"]["median"], 2),
                "-" if calls is None else f"{calls['tokens']} / {calls['rows']}",
            ]
        )
    head = (
        f"Split by load, {by_load['model']} {by_load['size']} px, {by_load['steps']} steps,"
        f" batches of up to {by_load['max_batch_size']}: alone, one request's latency on an"
        f" idle engine; deep, {by_load['deep']} requests submitted at once (medians of"
        f" {by_load['rounds']} rounds of {by_load['repeats']} repeats, each round every arm in"
        f" turn). By load over always-Ulysses: alone"
        f" {by_load['alone_ratio_over_tokens']:.2f}x the latency,"
        f" deep {by_load['deep_ratio_over_tokens']:.2f}x the throughput; over one rank:"
        f" {by_load['alone_ratio_over_one_rank']:.2f}x and"
        f" {by_load['deep_ratio_over_one_rank']:.2f}x.\n\n"
    )
    return head + md_table(
        ["arm", "alone, ms", "deep, requests/s", "model calls: tokens / rows split"], rows
    )


def _layouts_table(result: dict[str, Any]) -> str:
    """layout | step ms (2 ranks, 1 thread, 2 threads) | ratios | seeds' table | plan µs."""
    rows = []
    for r in result["layouts"]:
        step = r["step_ms"]
        rows.append(
            [
                f"{_LABELS[r['layout']]}, {r['model']} {r['size']} px",
                fmt(step["ranks"]["median"], 1),
                fmt(step["one_thread"]["median"], 1),
                fmt(step["two_threads"]["median"], 1),
                f"{r['step_ratio_over_one_thread']:.2f}x / {r['step_ratio_over_two_threads']:.2f}x",
                fmt(r["baseline_s"]["median"] * 1e3, 0),
                fmt(r["post_abort_s"]["median"] * 1e3, 0),
                f"{r['overhead_pct']:+.1f} %",
                f"{r['recovered']:.0f}/{r['aborts']}",
                f"{r['plan_delivery_us']['p50']:.0f} / {r['plan_delivery_us']['p99']:.0f}",
            ]
        )
    return md_table(
        [
            "layout",
            "2 ranks",
            "1 rank, 1 thread",
            "1 rank, 2 threads",
            "2 ranks / 1 rank (1 / 2 threads)",
            "baseline (B alone), ms",
            "post-abort (B), ms",
            "overhead",
            "recovered",
            "plan delivery, µs",
        ],
        rows,
    )


def plot_ranks(result: dict[str, Any], path: Path) -> None:
    """Step time per layout: two ranks against one rank of one and of two threads."""
    layouts = result["layouts"]
    arms = (
        ("ranks", "2 ranks"),
        ("one_thread", "1 rank, 1 thread"),
        ("two_threads", "1 rank, 2 threads"),
    )
    with figure(path, columns=1, title="ranks: step time, two ranks vs one") as axes:
        ax = axes[0]
        width = 0.8 / len(arms)
        for index, (arm, label) in enumerate(arms):
            xs = [i + (index - 1) * width for i in range(len(layouts))]
            ax.bar(xs, [r["step_ms"][arm]["median"] for r in layouts], width=width, label=label)
        ax.set_xticks(
            range(len(layouts)),
            [f"{_LABELS[r['layout']]}\n{r['model']} {r['size']} px" for r in layouts],
        )
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
