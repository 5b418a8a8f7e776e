"""``join``: a short request arriving while a long batch runs: how long until it steps?

Tiny SD at 64 px. A batch of three 30-step requests runs; after a random number of
its steps, plus a random fraction of a step, a 4-step request of the same size
arrives. The figure is its wait: from its submission until the worker takes it
into the batch at a step boundary (``RequestMetrics.queue_wait_s``), in units of
the long batch's step time; the time to its first step event (the wait, its
prompt encoding and its first step) is given beside it, and the wait minus the
duration of the step in progress when it arrived (the runner notes each step's
start and end). The naive peer runs the
long batch as one pipeline call of three images behind the lock; the short
request waits for the lock, that is, for the whole rest of the call and its decode.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from omni_trio import EngineConfig, open_engine

from .common import Options, fmt, md_table, shared_pipeline, spread_p99
from .peers import Call, LockedPipeline, TimedRunner, sd_request, start_call, step_in_progress
from .plot import PEER_COLORS, figure

__all__ = ["plot_join", "run_join", "table_join"]

SIZE = 64
LONG_STEPS = 30
LONG_MEMBERS = 3
SHORT_STEPS = 4


def _step_s(times: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(times))


async def _engine_trials(trials: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    pipe = shared_pipeline("sd")
    out: dict[str, list[float]] = {
        "wait_s": [],
        "first_step_s": [],
        "step_s": [],
        "over_step_s": [],
    }
    runner = TimedRunner(pipe, max_batch_size=LONG_MEMBERS + 1)
    config = EngineConfig(max_batch_size=LONG_MEMBERS + 1)
    async with open_engine(runner, config) as engine:
        await engine.generate(sd_request(2, SIZE))  # warm-up
        for trial in range(trials):
            at = rng.randint(4, 12)
            async with AsyncExitStack() as stack:
                longs = [
                    await stack.enter_async_context(
                        engine.submit(sd_request(LONG_STEPS, SIZE, seed=trial * 10 + j))
                    )
                    for j in range(LONG_MEMBERS)
                ]
                times: list[float] = []
                async for event in longs[0]:
                    times.append(time.perf_counter())
                    if event.step >= at:
                        break
                step_s = _step_s(times)
                await anyio.sleep(rng.random() * step_s)
                submitted = time.perf_counter()
                async with engine.submit(sd_request(SHORT_STEPS, SIZE, seed=trial)) as short:
                    async for _ in short:
                        out["first_step_s"].append(time.perf_counter() - submitted)
                        break
                    output = await short.result()
                out["wait_s"].append(output.metrics.queue_wait_s)
                out["step_s"].append(step_s)
                in_progress, _ = step_in_progress(runner.steps, submitted)
                out["over_step_s"].append(output.metrics.queue_wait_s - in_progress)
                del output
                # Leaving the stack aborts the long requests: the next trial starts afresh.
    return out


async def _naive_trials(trials: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    peer = LockedPipeline(shared_pipeline("sd"), interrupt=False)
    await peer.run(Call(sd_request(2, SIZE)))  # warm-up
    out: dict[str, list[float]] = {"wait_s": [], "first_step_s": [], "step_s": []}
    for trial in range(trials):
        at = rng.randint(4, 12)
        long = Call(sd_request(LONG_STEPS, SIZE, seed=trial, num_images=LONG_MEMBERS))
        async with anyio.create_task_group() as group:
            start_call(group, peer, long)
            await peer.wait_steps(long, at)
            step_s = _step_s(long.step_times)
            await anyio.sleep(rng.random() * step_s)
            short = Call(sd_request(SHORT_STEPS, SIZE, seed=trial))
            await peer.run(short)
        assert short.t_acquired is not None and short.step_times
        out["wait_s"].append(short.t_acquired - short.t_submitted)
        out["first_step_s"].append(short.step_times[0] - short.t_submitted)
        out["step_s"].append(step_s)
    await peer.wait_idle()
    return out


async def _measure(trials: int, naive_trials: int) -> dict[str, dict[str, list[float]]]:
    return {
        "omni_trio": await _engine_trials(trials, seed=0),
        "naive": await _naive_trials(naive_trials, seed=1),
    }


def run_join(options: Options) -> dict[str, Any]:
    """Time a short request's wait to join a running batch, engine vs naive."""
    trials, naive_trials = (4, 2) if options.quick else (50, 6)
    data = options.run(_measure, trials, naive_trials)
    peers: dict[str, Any] = {}
    for name, d in data.items():
        steps = [w / s for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
        first = [f / s for f, s in zip(d["first_step_s"], d["step_s"], strict=True)]
        peers[name] = {
            "wait_steps": spread_p99(steps),
            "time_to_first_step_steps": spread_p99(first),
            "wait_ms": spread_p99([w * 1e3 for w in d["wait_s"]]),
            "batch_step_ms": spread_p99([s * 1e3 for s in d["step_s"]]),
            "samples_wait_steps": steps,
        }
        if "over_step_s" in d:
            peers[name]["wait_minus_step_in_progress_ms"] = spread_p99(
                [v * 1e3 for v in d["over_step_s"]]
            )
    engine = peers["omni_trio"]
    return {
        "config": {
            "model": "tiny sd",
            "size": SIZE,
            "long_steps": LONG_STEPS,
            "long_members": LONG_MEMBERS,
            "short_steps": SHORT_STEPS,
            "trials": trials,
            "naive_trials": naive_trials,
            "backend": options.backend,
        },
        "peers": peers,
        "summary": {
            "first_step_wait_steps": engine["wait_steps"]["p99"],
            "first_step_wait_steps_p50": engine["wait_steps"]["median"],
            "time_to_first_step_steps_p50": engine["time_to_first_step_steps"]["median"],
            "naive_first_step_wait_steps_p50": peers["naive"]["wait_steps"]["median"],
            "batch_step_ms": engine["batch_step_ms"]["median"],
            "wait_minus_step_in_progress_p99_ms": engine["wait_minus_step_in_progress_ms"]["p99"],
        },
    }


def table_join(result: dict[str, Any]) -> str:
    """The wait to join, and the time to the first step, per peer."""
    rows = []
    for name in ("omni_trio", "naive"):
        p = result["peers"][name]
        w = p["wait_steps"]
        rows.append(
            [
                name,
                f"{int(w['n'])}",
                fmt(p["batch_step_ms"]["median"], 1),
                fmt(w["median"]),
                fmt(w["p99"]),
                fmt(p["time_to_first_step_steps"]["median"]),
                fmt(p["wait_ms"]["median"], 1),
            ]
        )
    config = result["config"]
    head = (
        f"A {config['short_steps']}-step request arrives while {config['long_members']}"
        f" {config['long_steps']}-step requests run as one batch (tiny SD, {config['size']} px)."
        " Wait: submission to the step boundary where it joins (naive: to getting the lock),"
        " in the long batch's steps (median step of the batch before the arrival). Target:"
        " p99 ≤ 1 step. The wait minus the duration of the step that was running when the"
        " request arrived (no request can join inside a step), p99:"
        f" {result['summary']['wait_minus_step_in_progress_p99_ms']:.2f} ms.\n\n"
    )
    return head + md_table(
        [
            "peer",
            "n",
            "batch step ms",
            "wait p50 steps",
            "wait p99 steps",
            "to first step event p50, steps",
            "wait p50 ms",
        ],
        rows,
    )


def plot_join(result: dict[str, Any], path: Path) -> None:
    """Each trial's wait in steps, per peer (log scale)."""
    peers = ["omni_trio", "naive"]
    with figure(path, title="join: a short request's wait for a running batch") as (ax,):
        for i, name in enumerate(peers):
            values = result["peers"][name]["samples_wait_steps"]
            ax.scatter([i] * len(values), values, color=PEER_COLORS[name], alpha=0.6)
            ax.hlines(statistics.median(values), i - 0.25, i + 0.25, color="k")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="target: 1 step")
        ax.set_xticks(range(len(peers)), peers)
        ax.set_yscale("log")
        ax.set_ylabel("wait, steps of the long batch")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
