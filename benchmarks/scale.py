"""``scale``: admission and abort cost per request with 10 to 10,000 requests waiting.

A ``GatedRunner`` holds the worker: one request sits in its first step, so every
request submitted after it waits (``max_batch_size`` 1). For each queue length N:
submit N requests (``engine.submit``), then abort each (``await engine.abort``),
then close their handles; the cost per request is the total over N. The lengths
are interleaved over the repeats. The same again with requests that carry a
deadline (far off, spread over the queue), with a measured step time assumed, so
that every admission runs the deadline estimate (L62: the steps ranked ahead, by
prefix sums over deadlines) and every abort takes the request out of those sums.
The time Python's cyclic garbage collector spends inside each timed window is
measured too (``gc.callbacks``) and given beside: a full collection walks the
whole process's heap, model libraries included, whatever the queue holds. A
separate pass under ``tracemalloc`` (slow, so not timed) gives the Python memory
per waiting request. A flat cost per request across N means no operation scans
the queue.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import tracemalloc
from pathlib import Path
from typing import Any

from omni_trio import Engine, EngineConfig, GenerationRequest, RequestHandle, open_engine
from omni_trio.testing import GatedRunner, assume_step_time

from .common import Options, fmt, md_table, spread
from .plot import PEER_COLORS, figure

__all__ = ["plot_scale", "run_scale", "table_scale"]

LENGTHS = (10, 100, 1_000, 10_000)
#: The flatness ratios compare the largest queue with this one: below it, the
#: fixed cost of a burst (about 0.1 ms) dominates the cost per request.
FLAT_FROM = 100
#: A generous bound on how long the held step may wait; picked without measurement.
GATE_TIMEOUT_S = 600.0

_REQUEST = GenerationRequest(prompt="scale", num_steps=10, height=16, width=16, seed=0)
#: Deadlines far off (a day and more), so that none is refused or passes; a
#: measured step time this short keeps every estimate far below them.
DEADLINE_S = 86_400.0
ASSUMED_STEP_S = 1e-6
#: The series: cost per request, with and without a deadline.
SERIES = ("admit", "admit_no_gc", "abort", "abort_no_gc", "admit_deadline", "abort_deadline")


def _deadline_requests(n: int) -> list[GenerationRequest]:
    """``n`` requests whose deadlines fall all over the queue's order (not admission order)."""
    return [dataclasses.replace(_REQUEST, deadline_s=DEADLINE_S + (i * 7919) % n) for i in range(n)]


class _GcClock:
    """Time spent in Python's cyclic garbage collector while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def _fill(
    engine: Engine, n: int, requests: list[GenerationRequest] | None = None
) -> tuple[list[RequestHandle], float, _GcClock]:
    """Submit ``n`` requests (``requests``, or ``n`` of ``_REQUEST``); time it."""
    batch = requests if requests is not None else [_REQUEST] * n
    with _GcClock() as clock:
        started = time.perf_counter()
        handles = [engine.submit(request, request_id=f"w{i}") for i, request in enumerate(batch)]
        elapsed = time.perf_counter() - started
    return handles, elapsed, clock


async def _drain(engine: Engine, handles: list[RequestHandle]) -> tuple[float, _GcClock]:
    with _GcClock() as clock:
        started = time.perf_counter()
        for handle in handles:
            await engine.abort(handle.request_id)
        elapsed = time.perf_counter() - started
    for handle in handles:
        await handle.aclose()
    return elapsed, clock


def _full_collection_s() -> float:
    gc.collect()
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


async def _measure(lengths: tuple[int, ...], repeats: int) -> dict[str, Any]:
    runner = GatedRunner(gate_timeout=GATE_TIMEOUT_S)
    config = EngineConfig(max_batch_size=1, max_waiting=max(lengths) + 1)
    data: dict[str, dict[int, list[float]]] = {k: {n: [] for n in lengths} for k in SERIES}
    with_deadlines = {n: _deadline_requests(n) for n in lengths}
    full_collections = dict.fromkeys(lengths, 0)
    memory: dict[int, float] = {}
    async with open_engine(runner, config) as engine:
        async with engine.submit(_REQUEST, request_id="holder"):
            await runner.wait_arrived(1)  # the worker is held inside the first step
            assume_step_time(engine, ASSUMED_STEP_S)  # held: nothing overwrites it
            handles, _, _ = await _fill(engine, 100)  # warm-up
            await _drain(engine, handles)
            for _ in range(repeats):
                for n in lengths:
                    gc.collect()
                    handles, admit_s, admit_gc = await _fill(engine, n)
                    abort_s, abort_gc = await _drain(engine, handles)
                    del handles
                    data["admit"][n].append(admit_s / n)
                    data["admit_no_gc"][n].append((admit_s - admit_gc.seconds) / n)
                    data["abort"][n].append(abort_s / n)
                    data["abort_no_gc"][n].append((abort_s - abort_gc.seconds) / n)
                    full_collections[n] += admit_gc.full + abort_gc.full
                    gc.collect()
                    handles, admit_s, _ = await _fill(engine, n, with_deadlines[n])
                    abort_s, _ = await _drain(engine, handles)
                    del handles
                    data["admit_deadline"][n].append(admit_s / n)
                    data["abort_deadline"][n].append(abort_s / n)
            for n in lengths:
                gc.collect()
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
                handles, _, _ = await _fill(engine, n)
                memory[n] = (tracemalloc.get_traced_memory()[0] - base) / n
                tracemalloc.stop()
                await _drain(engine, handles)
                del handles
            # Leaving the block aborts the holder; the gate opens so the worker sees it.
            runner.open_gate()
    return {
        **data,
        "full_collections": full_collections,
        "memory_bytes": memory,
        "full_collection_s": _full_collection_s(),
        "gc_tracked_objects": len(gc.get_objects()),
    }


def run_scale(options: Options) -> dict[str, Any]:
    """Per-request admission and abort cost, and memory, at each queue length."""
    repeats = 2 if options.quick else 5
    data = options.run(_measure, LENGTHS, repeats)
    table = {
        key: {str(n): spread([v * 1e6 for v in data[key][n]]) for n in LENGTHS} for key in SERIES
    }
    memory = {str(n): data["memory_bytes"][n] for n in LENGTHS}
    admit_us = {n: s["median"] for n, s in table["admit"].items()}
    abort_us = {n: s["median"] for n, s in table["abort"].items()}
    deadline_us = {n: s["median"] for n, s in table["admit_deadline"].items()}
    largest, small = str(LENGTHS[-1]), str(FLAT_FROM)
    return {
        "config": {"lengths": list(LENGTHS), "repeats": repeats, "backend": options.backend},
        "us_per_request": table,
        "full_collections_per_fill_and_drain": {
            str(n): data["full_collections"][n] / repeats for n in LENGTHS
        },
        "full_collection_ms": data["full_collection_s"] * 1e3,
        "gc_tracked_objects": data["gc_tracked_objects"],
        "memory_bytes_per_waiting_request": memory,
        "summary": {
            "admit_us_per_request": admit_us,
            "abort_us_per_request": abort_us,
            "admit_us_per_request_without_gc": {
                n: s["median"] for n, s in table["admit_no_gc"].items()
            },
            "abort_us_per_request_without_gc": {
                n: s["median"] for n, s in table["abort_no_gc"].items()
            },
            "memory_bytes_per_waiting_request": memory,
            "admit_deadline_us_per_request": deadline_us,
            "abort_deadline_us_per_request": {
                n: s["median"] for n, s in table["abort_deadline"].items()
            },
            "admit_ratio_largest_over_100": admit_us[largest] / admit_us[small],
            "admit_deadline_ratio_largest_over_100": deadline_us[largest] / deadline_us[small],
            "abort_ratio_largest_over_100": abort_us[largest] / abort_us[small],
            "full_collection_ms": data["full_collection_s"] * 1e3,
        },
    }


def table_scale(result: dict[str, Any]) -> str:
    """Cost per request and memory per waiting request, by queue length."""
    us = result["us_per_request"]
    # Results written before the deadline series were measured have none.
    deadlines = "admit_deadline" in us
    rows = []
    for n in us["admit"]:
        admit = us["admit"][n]
        abort = us["abort"][n]
        with_deadline = (
            [fmt(us["admit_deadline"][n]["median"], 1), fmt(us["abort_deadline"][n]["median"], 1)]
            if deadlines
            else ["-", "-"]
        )
        rows.append(
            [
                f"{int(n):,}",
                fmt(admit["median"], 1),
                f"{fmt(admit['min'], 1)} - {fmt(admit['max'], 1)}",
                fmt(us["admit_no_gc"][n]["median"], 1),
                fmt(abort["median"], 1),
                f"{fmt(abort['min'], 1)} - {fmt(abort['max'], 1)}",
                fmt(us["abort_no_gc"][n]["median"], 1),
                *with_deadline,
                fmt(result["full_collections_per_fill_and_drain"][n], 1),
                fmt(result["memory_bytes_per_waiting_request"][n] / 1024, 2),
            ]
        )
    summary = result["summary"]
    deadline_ratio = (
        f", admission with a deadline x{summary['admit_deadline_ratio_largest_over_100']:.2f}"
        if deadlines
        else ""
    )
    head = (
        f"FakeRunner held inside a step; {result['config']['repeats']} interleaved repeats."
        f" 10,000 vs 100 waiting: admission x{summary['admit_ratio_largest_over_100']:.2f},"
        f" abort x{summary['abort_ratio_largest_over_100']:.2f}{deadline_ratio} per request."
        ' "without gc" subtracts the time spent in Python\'s cyclic garbage collector'
        " (gc.callbacks); one full collection of this process"
        f" ({result['gc_tracked_objects']:,} tracked objects) takes"
        f" {result['full_collection_ms']:.0f} ms. With a deadline: every request carries one"
        " (a day off, spread over the queue), so each admission runs the deadline estimate"
        " and each abort leaves its prefix sums.\n\n"
    )
    return head + md_table(
        [
            "waiting requests",
            "admit µs/request",
            "range",
            "admit without gc",
            "abort µs/request",
            "range",
            "abort without gc",
            "admit with a deadline",
            "abort with a deadline",
            "full collections",
            "KiB per waiting request",
        ],
        rows,
    )


def plot_scale(result: dict[str, Any], path: Path) -> None:
    """Cost per request against queue length (log x); memory per waiting request."""
    lengths = [int(n) for n in result["us_per_request"]["admit"]]
    with figure(path, columns=2, title="scale: per-request cost vs waiting requests") as (a, b):
        for key, label, style in (
            ("admit", "admit", "o-"),
            ("admit_no_gc", "admit without gc", "o:"),
            ("abort", "abort", "s-"),
            ("abort_no_gc", "abort without gc", "s:"),
            ("admit_deadline", "admit with a deadline", "^-"),
        ):
            if key not in result["us_per_request"]:
                continue
            values = [result["us_per_request"][key][str(n)] for n in lengths]
            medians = [v["median"] for v in values]
            low = [v["median"] - v["min"] for v in values]
            high = [v["max"] - v["median"] for v in values]
            a.errorbar(lengths, medians, yerr=[low, high], fmt=style, capsize=3, label=label)
        a.set_xscale("log")
        a.set_ylim(bottom=0)
        a.set_xlabel("waiting requests")
        a.set_ylabel("µs per request")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
        memory = [result["memory_bytes_per_waiting_request"][str(n)] / 1024 for n in lengths]
        b.plot(lengths, memory, "o-", color=PEER_COLORS["omni_trio"])
        b.set_xscale("log")
        b.set_ylim(bottom=0)
        b.set_xlabel("waiting requests")
        b.set_ylabel("KiB per waiting request (tracemalloc)")
        b.grid(alpha=0.3)
