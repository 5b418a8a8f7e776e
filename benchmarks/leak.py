"""``leak``: many requests ending every way there is; nothing they held may stay alive.

Tiny SD at 32 px, 4 steps, up to 8 requests in flight, batches of 4. Each request
ends one of eight ways, picked at random: completed; completed with previews read;
completed but its output never taken; aborted at a random step; aborted right after
submission (often still waiting); its consumer leaving after the first event; its
caller's task cancelled after a random delay; its caller's deadline
(``fail_after``) expiring. The live tensors (a gc scan, parameters excluded),
omni_trio's objects and the RSS are taken before and after the run, with the
engine still open and idle, each after ``gc.collect()`` and, where the C library
is glibc, ``malloc_trim(0)`` (free memory the allocator kept is not a leak).

The warm-up runs the same mix in rounds until the RSS stops moving: the
allocators (glibc's per-thread arenas, torch's, Python's) reach their high-water
mark only after a few hundred requests of this mix (measured: +3.4, +0.4, +0.04,
+0.0 MiB over four rounds of 500), and that growth is not a leak: a leak keeps
growing with the number of requests. Every warm-up round's growth is reported.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import anyio
import torch

from omni_trio import (
    Engine,
    EngineConfig,
    GenerationOutput,
    GenerationRequest,
    RequestHandle,
    StepEvent,
    open_engine,
)
from omni_trio._record import Record
from omni_trio.runners import DiffusersRunner
from omni_trio.testing import live_objects

from .common import Options, fmt, live_tensor_count, md_table, rss_bytes, shared_pipeline
from .peers import sd_request
from .plot import figure

__all__ = ["SCENARIOS", "plot_leak", "run_leak", "table_leak"]

SIZE = 32
STEPS = 4
#: Requests in flight at once. Picked without measurement: enough for batches
#: of 4 to form and for aborts to hit waiting requests.
IN_FLIGHT = 8
#: A warm-up round that moves the RSS by less than this ends the warm-up (MiB).
#: Picked without measurement, well below the 1 MiB target.
WARM_RSS_MIB = 0.25
#: The longest random delay before a cancellation or deadline, in seconds; about
#: one request's time in the queue here (picked without measurement).
MAX_DELAY_S = 0.08


SCENARIOS = (
    "completed",
    "previews_read",
    "output_not_taken",
    "aborted_running",
    "aborted_at_once",
    "consumer_closed",
    "caller_cancelled",
    "deadline",
)


async def _one(
    engine: Engine, scenario: str, request: GenerationRequest, rng: random.Random
) -> None:
    match scenario:
        case "completed":
            await engine.generate(request)
        case "previews_read":
            async with engine.submit(request) as handle:
                async for _ in handle:
                    pass
                await handle.result()
        case "output_not_taken":
            async with engine.submit(request) as handle:
                async for _ in handle:
                    pass
        case "aborted_running":
            at = rng.randint(1, STEPS - 1)
            async with engine.submit(request) as handle:
                async for event in handle:
                    if event.step >= at:
                        await handle.abort()
                        break
        case "aborted_at_once":
            async with engine.submit(request) as handle:
                await handle.abort()
        case "consumer_closed":
            async with engine.submit(request) as handle:
                async for _ in handle:
                    break
        case "caller_cancelled":
            async with anyio.create_task_group() as group:
                group.start_soon(engine.generate, request)
                await anyio.sleep(rng.uniform(0, MAX_DELAY_S))
                group.cancel_scope.cancel()
        case "deadline":
            try:
                with anyio.fail_after(rng.uniform(0, MAX_DELAY_S)):
                    await engine.generate(request)
            except TimeoutError:
                pass
        case _:
            raise ValueError(f"unknown scenario {scenario!r}")


async def _run_mix(engine: Engine, count: int, seed: int, counts: dict[str, int]) -> None:
    rng = random.Random(seed)
    limiter = anyio.CapacityLimiter(IN_FLIGHT)

    async def one(i: int, scenario: str) -> None:
        async with limiter:
            preview = 1 if scenario == "previews_read" else 0
            request = sd_request(STEPS, SIZE, seed=seed * 100_000 + i, preview_every=preview)
            await _one(engine, scenario, request, rng)

    async with anyio.create_task_group() as group:
        for i in range(count):
            scenario = rng.choice(SCENARIOS)
            counts[scenario] = counts.get(scenario, 0) + 1
            group.start_soon(one, i, scenario)


def _is_omni_trio(kind: type) -> bool:
    module = getattr(kind, "__module__", None)
    # Exported classes carry their public package's name, "omni_trio" included.
    return isinstance(module, str) and (module == "omni_trio" or module.startswith("omni_trio."))


def _held_by_omni_trio() -> int:
    """Tensors referenced from omni_trio objects (directly, or through a dict, list or tuple)."""
    gc.collect()
    owners = [obj for obj in gc.get_objects() if _is_omni_trio(type(obj))]
    seen: set[int] = set()
    count = 0
    frontier: list[Any] = list(gc.get_referents(*owners))
    for depth in range(2):
        following: list[Any] = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            kind = type(obj)
            if issubclass(kind, torch.Tensor) and not issubclass(kind, torch.nn.Parameter):
                count += 1
            elif depth == 0 and kind in (dict, list, tuple):
                following.extend(gc.get_referents(obj))
        frontier = following
    return count


def _settled_rss() -> int:
    """The RSS after a full collection and after glibc returned its free memory.

    Without the trim, the RSS also moves with memory that earlier work freed and
    the allocator kept (or returned at some arbitrary later moment): the previous
    benchmark in the same process can swing it by 10+ MiB either way.
    """
    gc.collect()
    return rss_bytes(trim=True)


def _snapshot(runner: DiffusersRunner) -> dict[str, float]:
    gc.collect()
    return {
        "tensors": float(live_tensor_count()),
        "omni_trio_held_tensors": float(_held_by_omni_trio()),
        "rss_bytes": float(_settled_rss()),
        "outputs": float(len(live_objects(GenerationOutput))),
        "step_events": float(len(live_objects(StepEvent))),
        "records": float(len(live_objects(Record))),
        "runner_live_states": float(runner.live_states),
    }


async def _measure(requests: int, warmup: int, warm_rounds: int) -> dict[str, Any]:
    runner = DiffusersRunner(shared_pipeline("sd"), max_batch_size=4)
    counts: dict[str, int] = {}
    warm_growth: list[float] = []
    async with open_engine(runner, EngineConfig(max_batch_size=4)) as engine:
        for round_ in range(warm_rounds):
            gc.collect()
            rss = _settled_rss()
            await _run_mix(engine, warmup, seed=1 + round_, counts={})
            gc.collect()
            warm_growth.append((_settled_rss() - rss) / 2**20)
            if abs(warm_growth[-1]) < WARM_RSS_MIB:
                break
        before = _snapshot(runner)
        # In quarters, with the RSS after each: a leak grows steadily, an
        # allocator's high-water mark does not.
        quarters: list[float] = []
        for quarter in range(4):
            await _run_mix(engine, requests // 4, seed=1000 + quarter, counts=counts)
            quarters.append((_settled_rss() - before["rss_bytes"]) / 2**20)
        after = _snapshot(runner)
        stats = engine.statistics()
        # Waiting and running count the live requests; an id stays taken after its
        # end only while its handle is alive.
        handles = len(live_objects(RequestHandle))
    closed = _snapshot(runner)
    return {
        "warmup_rss_growth_mib": warm_growth,
        "rss_growth_by_quarter_mib": quarters,
        "before": before,
        "after": after,
        "after_close": closed,
        "scenarios": counts,
        "statistics": {
            "completed": stats.completed,
            "aborted": stats.aborted,
            "failed": stats.failed,
            "waiting": stats.waiting,
            "running": stats.running,
            "live_handles": handles,
        },
    }


def run_leak(options: Options) -> dict[str, Any]:
    """Run the mix; compare live tensors, objects and RSS before and after."""
    # Quick: a smoke run (the test of the suite runs every benchmark under a time limit).
    requests, warmup, rounds = (40, 20, 1) if options.quick else (1000, 250, 8)
    data = options.run(_measure, requests, warmup, rounds)
    before, after = data["before"], data["after"]
    growth = {key: after[key] - before[key] for key in before}
    rss_growth_mib = growth["rss_bytes"] / 2**20
    return {
        "config": {
            "model": "tiny sd",
            "size": SIZE,
            "steps": STEPS,
            "requests": requests,
            "warmup_requests_per_round": warmup,
            "warmup_max_rounds": rounds,
            "in_flight": IN_FLIGHT,
            "backend": options.backend,
        },
        **data,
        "growth": growth,
        "summary": {
            "live_tensors": growth["tensors"],
            "rss_growth_mib": rss_growth_mib,
            "omni_trio_held_tensors": after["omni_trio_held_tensors"],
            "live_outputs": after["outputs"],
            "live_step_events": after["step_events"],
            "live_records": after["records"],
            "runner_live_states": after["runner_live_states"],
            "rss_growth_kib_per_request": growth["rss_bytes"] / 1024 / requests,
        },
    }


def table_leak(result: dict[str, Any]) -> str:
    """Before and after, and what the requests did."""
    rows = []
    labels = {
        "tensors": "live torch tensors (gc scan)",
        "omni_trio_held_tensors": "tensors held by omni_trio objects",
        "outputs": "GenerationOutput objects",
        "step_events": "StepEvent objects",
        "records": "request records",
        "runner_live_states": "runner states (runner.live_states)",
    }
    for key, label in labels.items():
        rows.append(
            [
                label,
                fmt(result["before"][key], 0),
                fmt(result["after"][key], 0),
                f"{result['growth'][key]:+.0f}",
            ]
        )
    rows.append(
        [
            "RSS, MiB",
            fmt(result["before"]["rss_bytes"] / 2**20, 1),
            fmt(result["after"]["rss_bytes"] / 2**20, 1),
            f"{result['growth']['rss_bytes'] / 2**20:+.2f}",
        ]
    )
    config = result["config"]
    stats = result["statistics"]
    mix = ", ".join(f"{name} {n}" for name, n in sorted(result["scenarios"].items()))
    warm = ", ".join(f"{g:+.2f}" for g in result["warmup_rss_growth_mib"])
    quarters = ", ".join(f"{g:+.2f}" for g in result["rss_growth_by_quarter_mib"])
    head = (
        f"{config['requests']} requests (tiny SD, {config['size']} px, {config['steps']} steps,"
        f" {config['in_flight']} in flight) after {len(result['warmup_rss_growth_mib'])} warm-up"
        f" rounds of {config['warmup_requests_per_round']} (RSS growth per round, MiB: {warm})."
        f" Mix: {mix}. Engine counts, warm-up included: {stats['completed']} completed,"
        f" {stats['aborted']} aborted, {stats['failed']} failed. RSS growth after each quarter"
        f" of the run, MiB: {quarters}.\n\n"
    )
    return head + md_table(["measure", "before", "after", "growth"], rows)


def plot_leak(result: dict[str, Any], path: Path) -> None:
    """Live objects before and after (annotated), and RSS before, after and at close."""
    keys = ["tensors", "outputs", "step_events", "records", "runner_live_states"]
    with figure(path, columns=2, title="leak: after the mix vs before") as (left, right):
        x = range(len(keys))
        before = [result["before"][k] for k in keys]
        after = [result["after"][k] for k in keys]
        left.bar([i - 0.2 for i in x], before, width=0.4, color="#bbbbbb", label="before")
        left.bar([i + 0.2 for i in x], after, width=0.4, color="#1f77b4", label="after")
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            left.annotate(f"{a - b:+.0f}", (i, max(a, b)), ha="center", va="bottom")
        left.set_xticks(list(x), keys, rotation=25)
        left.set_ylabel("live objects (growth annotated)")
        left.set_ylim(0, max([*before, *after, 1.0]) * 1.25)
        left.legend(fontsize=8)
        left.grid(axis="y", alpha=0.3)
        mib = [result[k]["rss_bytes"] / 2**20 for k in ("before", "after", "after_close")]
        right.bar(["before", "after", "engine closed"], mib, color="#7f7f7f")
        right.set_ylim(bottom=max(0.0, min(mib) - 5), top=max(mib) + 2)
        right.set_ylabel("RSS, MiB")
        growth = result["summary"]["rss_growth_mib"]
        right.set_title(f"growth {growth:+.2f} MiB (target ≤ 1 MiB)", fontsize=9)
        right.grid(axis="y", alpha=0.3)
