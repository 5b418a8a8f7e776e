"""``overhead``: sequential requests through the engine vs the runner's bare loop.

Two measurements, peers interleaved in each repeat:

- tiny SD at 96 px (about 10 ms per step on one CPU thread): raw (the runner's
  loop), naive (the pipeline's own call in a thread) and the engine. The headline
  ratio ``ratio_engine_over_raw`` comes from here.
- ``FakeRunner`` with 0 s steps: nothing but the engine's own work per step
  (hand-off, boundary check, event). ``per_step_overhead_us`` comes from here.
  It is measured twice: on all CPUs (the default; the headline) and with the
  process pinned to one CPU, with the context switches per step: the hand-off
  of each step event between the worker and the event loop's thread costs more
  when the two threads run on two cores and pass the GIL between them.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_trio import Engine, EngineConfig, GenerationRequest, open_engine
from omni_trio.runners import DiffusersRunner
from omni_trio.testing import FakeRunner

from .common import Options, fmt, md_table, shared_pipeline, spread
from .peers import Call, LockedPipeline, median_step_s, run_raw, sd_request
from .plot import PEER_COLORS, bar_with_range, figure

__all__ = ["plot_overhead", "run_overhead", "table_overhead"]

#: Pixels per side where a tiny SD step takes about 10 ms on one thread (measured
#: here: 7.7 ms at 64 px, 9.6 ms at 96 px, 12.9 ms at 128 px).
SD_SIZE = 96


def _fake_raw(runner: FakeRunner, request: GenerationRequest, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        state = runner.prepare(request, "raw")
        for _ in range(request.num_steps):
            runner.step([state])
        runner.decode(state).float().cpu()
        runner.discard(state)
    return time.perf_counter() - started


async def _sequential(engine: Engine, request: GenerationRequest, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        await engine.generate(request)
    return time.perf_counter() - started


async def _naive(peer: LockedPipeline, request: GenerationRequest, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        await peer.run(Call(request, observe=False))
    return time.perf_counter() - started


async def _measure_sd(steps: int, requests: int, repeats: int) -> dict[str, Any]:
    pipe = shared_pipeline("sd")
    request = sd_request(steps, SD_SIZE)
    runner = DiffusersRunner(pipe)
    naive = LockedPipeline(pipe, interrupt=False)
    step_s = median_step_s(runner, request)
    times: dict[str, list[float]] = {"raw": [], "naive": [], "omni_trio": []}
    # Mean step time per request, raw and inside the engine (its denoise stage).
    model_steps: dict[str, list[float]] = {"raw": [], "omni_trio": []}
    async with open_engine(DiffusersRunner(pipe), EngineConfig(max_batch_size=1)) as engine:
        await engine.generate(request)  # warm-up: threads, first allocations
        await naive.run(Call(request, observe=False))
        for _ in range(repeats):
            raw_runs = [run_raw(runner, request) for _ in range(requests)]
            times["raw"].append(sum(run.total_s for run in raw_runs))
            model_steps["raw"] += [sum(run.step_s) / len(run.step_s) for run in raw_runs]
            times["naive"].append(await _naive(naive, request, requests))
            started = time.perf_counter()
            for _ in range(requests):
                output = await engine.generate(request)
                model_steps["omni_trio"].append(
                    output.metrics.stage_durations["denoise"] / request.num_steps
                )
                del output
            times["omni_trio"].append(time.perf_counter() - started)
    return {"step_s": step_s, "times": times, "model_steps": model_steps}


@contextmanager
def _cpus(cpus: set[int] | None) -> Iterator[None]:
    """Run this thread (and the threads it starts) on ``cpus``; all of them for ``None``."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def _switches() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


async def _measure_fake(steps: int, requests: int, repeats: int) -> dict[str, list[float]]:
    request = GenerationRequest(prompt="overhead", num_steps=steps, height=16, width=16, seed=0)
    raw_runner = FakeRunner()
    _fake_raw(raw_runner, request, 1)  # warm-up
    out: dict[str, list[float]] = {"raw": [], "omni_trio": [], "switches_per_step": []}
    async with open_engine(FakeRunner(), EngineConfig(max_steps=steps)) as engine:
        await engine.generate(request)
        for _ in range(repeats):
            out["raw"].append(_fake_raw(raw_runner, request, requests))
            switches = _switches()
            out["omni_trio"].append(await _sequential(engine, request, requests))
            out["switches_per_step"].append((_switches() - switches) / (steps * requests))
    return out


def _fake_figures(fake: dict[str, list[float]], total_steps: int) -> dict[str, Any]:
    pairs = list(zip(fake["omni_trio"], fake["raw"], strict=True))
    return {
        "raw_s": spread(fake["raw"]),
        "engine_s": spread(fake["omni_trio"]),
        "ratio_engine_over_raw": spread([e / r for e, r in pairs]),
        "per_step_overhead_us": spread([(e - r) / total_steps * 1e6 for e, r in pairs]),
        "context_switches_per_step": spread(fake["switches_per_step"]),
    }


def run_overhead(options: Options) -> dict[str, Any]:
    """Time sequential requests, engine vs raw (and naive), interleaved per repeat."""
    quick = options.quick
    sd_steps, sd_requests, sd_repeats = (8, 1, 3) if quick else (20, 2, 11)
    fake_steps, fake_requests, fake_repeats = (200, 2, 3) if quick else (1000, 10, 5)
    sd = options.run(_measure_sd, sd_steps, sd_requests, sd_repeats)
    fake_total = fake_steps * fake_requests
    fake = _fake_figures(
        options.run(_measure_fake, fake_steps, fake_requests, fake_repeats), fake_total
    )
    # The same on one CPU: the engine's two threads then take turns on one core
    # instead of handing the GIL across two (see docs/performance.md).
    one_cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    with _cpus(None if one_cpu is None else {one_cpu}):
        fake_one = _fake_figures(
            options.run(_measure_fake, fake_steps, fake_requests, fake_repeats), fake_total
        )
    times: dict[str, list[float]] = sd["times"]
    raw = times["raw"]
    sd_total_steps = sd_steps * sd_requests
    ratios = [e / r for e, r in zip(times["omni_trio"], raw, strict=True)]
    naive_ratios = [n / r for n, r in zip(times["naive"], raw, strict=True)]
    sd_us = [(e - r) / sd_total_steps * 1e6 for e, r in zip(times["omni_trio"], raw, strict=True)]
    return {
        "config": {
            "sd": {
                "size": SD_SIZE,
                "steps_per_request": sd_steps,
                "requests_per_repeat": sd_requests,
                "repeats": sd_repeats,
            },
            "fake": {
                "step_seconds": 0.0,
                "steps_per_request": fake_steps,
                "requests_per_repeat": fake_requests,
                "repeats": fake_repeats,
            },
            "backend": options.backend,
        },
        "sd": {
            "step_ms": sd["step_s"] * 1e3,
            "per_request_s": {
                peer: spread([t / sd_requests for t in values]) for peer, values in times.items()
            },
            "ratio_engine_over_raw": spread(ratios),
            "ratio_naive_over_raw": spread(naive_ratios),
            "per_step_overhead_us": spread(sd_us),
            "model_step_ms": {
                k: spread([v * 1e3 for v in vs]) for k, vs in sd["model_steps"].items()
            },
        },
        "fake": fake,
        "fake_one_cpu": fake_one,
        "summary": {
            "ratio_engine_over_raw": spread(ratios)["median"],
            "per_step_overhead_us": fake["per_step_overhead_us"]["median"],
            "sd_step_ms": sd["step_s"] * 1e3,
            "sd_per_step_overhead_us": spread(sd_us)["median"],
            "sd_step_ratio_engine_over_raw": (
                spread(sd["model_steps"]["omni_trio"])["median"]
                / spread(sd["model_steps"]["raw"])["median"]
            ),
            "ratio_naive_over_raw": spread(naive_ratios)["median"],
            "fake_ratio_engine_over_raw": fake["ratio_engine_over_raw"]["median"],
            "per_step_overhead_us_one_cpu": fake_one["per_step_overhead_us"]["median"],
            "context_switches_per_step": fake["context_switches_per_step"]["median"],
            "context_switches_per_step_one_cpu": fake_one["context_switches_per_step"]["median"],
        },
    }


def table_overhead(result: dict[str, Any]) -> str:
    """The per-request times of the peers and the per-step cost."""
    sd = result["sd"]
    config = result["config"]
    raw = sd["per_request_s"]["raw"]["median"]
    rows = []

    def row(label: str, s: dict[str, float], ratio: float, added: str) -> list[str]:
        ms = [fmt(s[key] * 1e3, 1) for key in ("median", "min", "max")]
        return [label, *ms, fmt(ratio, 3), added]

    for peer, label in (("raw", "raw (runner loop)"), ("naive", "naive (pipeline call)")):
        s = sd["per_request_s"][peer]
        rows.append(row(label, s, s["median"] / raw, "-"))
    rows.append(
        row(
            "omni_trio",
            sd["per_request_s"]["omni_trio"],
            sd["ratio_engine_over_raw"]["median"],
            fmt(sd["per_step_overhead_us"]["median"], 1),
        )
    )
    for key, label in (("fake", "all CPUs"), ("fake_one_cpu", "one CPU")):
        fake = result[key]
        rows.append(
            [
                f"omni_trio, FakeRunner 0 s steps, {label}",
                fmt(fake["engine_s"]["median"] * 1e3, 1),
                fmt(fake["engine_s"]["min"] * 1e3, 1),
                fmt(fake["engine_s"]["max"] * 1e3, 1),
                fmt(fake["ratio_engine_over_raw"]["median"], 2),
                fmt(fake["per_step_overhead_us"]["median"], 1),
            ]
        )
    summary = result["summary"]
    model = sd["model_step_ms"]
    head = (
        f"Tiny SD, {config['sd']['size']} px, {config['sd']['steps_per_request']} steps of"
        f" {sd['step_ms']:.1f} ms, {config['sd']['requests_per_repeat']} requests x"
        f" {config['sd']['repeats']} repeats; FakeRunner: {config['fake']['requests_per_repeat']}"
        f" x {config['fake']['steps_per_request']} steps x {config['fake']['repeats']} repeats"
        " (its times are per repeat), on all CPUs and pinned to one. Tiny SD's model step"
        f" alone: {model['raw']['median']:.2f} ms raw, {model['omni_trio']['median']:.2f} ms"
        " inside the engine (its denoise stage;"
        f" x{summary['sd_step_ratio_engine_over_raw']:.3f}). Context switches per"
        f" FakeRunner step: {summary['context_switches_per_step']:.2f} on all CPUs,"
        f" {summary['context_switches_per_step_one_cpu']:.2f} on one.\n\n"
    )
    return head + md_table(
        ["peer", "ms per request", "min", "max", "ratio to raw", "µs added per step"], rows
    )


def plot_overhead(result: dict[str, Any], path: Path) -> None:
    """Per-request time of each peer; the engine's added cost per step."""
    sd = result["sd"]
    peers = ["raw", "naive", "omni_trio"]
    with figure(path, columns=2, title="overhead: sequential requests") as (left, right):
        bar_with_range(
            left,
            peers,
            [sd["per_request_s"][p] for p in peers],
            colors=[PEER_COLORS[p] for p in peers],
            ylabel="ms per request (tiny SD)",
            scale=1e3,
        )
        bar_with_range(
            right,
            ["all CPUs", "one CPU"],
            [
                result["fake"]["per_step_overhead_us"],
                result["fake_one_cpu"]["per_step_overhead_us"],
            ],
            colors=[PEER_COLORS["omni_trio"], "#9467bd"],
            ylabel="µs added per step, FakeRunner 0 s steps",
        )
        right.axhline(30, color="k", linestyle="--", linewidth=1, label="target 30 µs")
        right.legend()
