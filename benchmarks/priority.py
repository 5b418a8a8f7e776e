"""``priority``: short urgent requests arriving while long background batches run.

Tiny SD at 64 px, batches of two. In each trial four 30-step background requests
are admitted (two run, two wait); after a random number of steps of the running
batch, plus a random fraction of a step, a 4-step urgent request arrives. Its wait
(``RequestMetrics.queue_wait_s``, submission to the boundary where the worker takes
it) is given in steps of the batch. Three ways of running the same load:

- ``fifo``: every request has priority 0; the urgent one waits for all four
  background requests ahead of it.
- ``priority``: the urgent request has priority 1, background 0, and preemption is
  off (``EngineConfig(preemption=False)``): it goes to the head of the queue, but
  waits for the running batch to end.
- ``preemption``: the same priorities, preemption on (L61): at the next step
  boundary the lowest-ranked background request is suspended and the urgent one
  takes its place.

The background requests' cost is their mean time from admission to their last step,
over the ``fifo`` figure. ``resume_max_abs_diff`` compares a background request that
was suspended and resumed with the same request run uninterrupted: alone both times
(the same batch composition: bitwise), and resumed into another batch than the one
it started in (batching's float tolerance).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from omni_trio import EngineConfig, GenerationRequest, RequestHandle, open_engine
from omni_trio.runners import DiffusersRunner

from .common import Options, fmt, md_table, shared_pipeline, spread_p99
from .peers import TimedRunner, sd_request
from .plot import figure

__all__ = ["plot_priority", "run_priority", "table_priority"]

SIZE = 64
LONG_STEPS = 30
BACKGROUND = 4
BATCH = 2
SHORT_STEPS = 4
MODES = ("fifo", "priority", "preemption")


def _config(mode: str) -> EngineConfig:
    return EngineConfig(max_batch_size=BATCH, preemption=mode == "preemption")


async def _trials(mode: str, trials: int, seed: int, long_steps: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    urgent_priority = 0 if mode == "fifo" else 1
    runner = TimedRunner(shared_pipeline("sd"), max_batch_size=BATCH)
    out: dict[str, list[float]] = {"wait_s": [], "step_s": [], "background_s": []}
    async with open_engine(runner, _config(mode)) as engine:
        await engine.generate(sd_request(2, SIZE))  # warm-up
        for trial in range(trials):
            at = rng.randint(3, long_steps // 2)
            handles = [
                engine.submit(sd_request(long_steps, SIZE, seed=trial * 10 + j))
                for j in range(BACKGROUND)
            ]
            first = handles[0]
            async for event in first:
                if event.step >= at:
                    break
            recent = [end - start for start, end in runner.steps[-4:]]
            step_s = statistics.median(recent)
            await anyio.sleep(rng.random() * step_s)
            urgent = engine.submit(
                sd_request(SHORT_STEPS, SIZE, seed=trial, priority=urgent_priority)
            )
            outputs = []
            for handle in (urgent, *handles):
                async with handle:
                    outputs.append(await handle.result())
            out["wait_s"].append(outputs[0].metrics.queue_wait_s)
            out["step_s"].append(step_s)
            out["background_s"].append(
                statistics.mean(o.metrics.queue_wait_s + o.metrics.exec_s for o in outputs[1:])
            )
            del outputs
    return out


async def _suspended_image(
    runner: DiffusersRunner, request: GenerationRequest, partners: list[GenerationRequest]
) -> torch.Tensor:
    """``request``'s image when an urgent request suspends it after its third step.

    ``partners`` run beside it from the start, and are still waiting (suspended
    or never started) when it resumes, so its batch-mates differ before and after.
    """
    config = EngineConfig(max_batch_size=1 + len(partners))
    async with open_engine(runner, config) as engine:
        handle = engine.submit(request)
        others: list[RequestHandle] = [engine.submit(p) for p in partners]
        async for event in handle:
            if event.step >= 3:
                break
        urgent = [
            engine.submit(sd_request(2, SIZE, seed=90 + i, priority=1))
            for i in range(1 + len(partners))
        ]
        for extra in (*urgent, *others):
            async with extra:
                await extra.result()
        async with handle:
            output = await handle.result()
        assert output.metrics.preemptions >= 1, "the request was never suspended"
        return output.images


async def _resume_diffs() -> dict[str, float]:
    pipe = shared_pipeline("sd")
    request = sd_request(12, SIZE, seed=5)
    async with open_engine(DiffusersRunner(pipe), EngineConfig(max_batch_size=1)) as engine:
        alone = (await engine.generate(request)).images
    resumed_alone = await _suspended_image(DiffusersRunner(pipe), request, [])
    partner = sd_request(12, SIZE, seed=6)
    rebatched = await _suspended_image(DiffusersRunner(pipe), request, [partner])
    return {
        "same_batch": float((resumed_alone - alone).abs().max()),
        "rebatched": float((rebatched - alone).abs().max()),
    }


async def _measure(trials: int, long_steps: int) -> dict[str, Any]:
    data: dict[str, Any] = {}
    # Interleaved by trial block, so a change of machine load hits every mode alike.
    blocks = 2 if trials >= 4 else 1
    for block in range(blocks):
        for mode in MODES:
            got = await _trials(mode, trials // blocks, seed=block, long_steps=long_steps)
            for key, values in got.items():
                data.setdefault(mode, {}).setdefault(key, []).extend(values)
    data["resume"] = await _resume_diffs()
    return data


def run_priority(options: Options) -> dict[str, Any]:
    """Time an urgent request's wait behind background batches: FIFO, priorities, preemption."""
    torch.set_num_threads(1)
    trials, long_steps = (2, 8) if options.quick else (20, LONG_STEPS)
    started = time.perf_counter()
    data = options.run(_measure, trials, long_steps)
    peers: dict[str, Any] = {}
    for mode in MODES:
        d = data[mode]
        steps = [w / s for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
        peers[mode] = {
            "wait_steps": spread_p99(steps),
            "wait_ms": spread_p99([w * 1e3 for w in d["wait_s"]]),
            "batch_step_ms": spread_p99([s * 1e3 for s in d["step_s"]]),
            "background_s": spread_p99(d["background_s"]),
            "samples_wait_steps": steps,
        }
    fifo_background = peers["fifo"]["background_s"]["median"]
    for mode in MODES:
        peers[mode]["background_over_fifo"] = (
            peers[mode]["background_s"]["median"] / fifo_background
        )
    resume = data["resume"]
    return {
        "config": {
            "model": "tiny sd",
            "size": SIZE,
            "long_steps": long_steps,
            "background": BACKGROUND,
            "batch": BATCH,
            "short_steps": SHORT_STEPS,
            "trials": trials,
            "backend": options.backend,
            "seconds": time.perf_counter() - started,
        },
        "peers": peers,
        "summary": {
            "high_priority_p99_wait_steps": {
                mode: peers[mode]["wait_steps"]["p99"] for mode in MODES
            },
            "high_priority_p99_wait_steps_preemption": peers["preemption"]["wait_steps"]["p99"],
            "background_slowdown_preemption_over_fifo": peers["preemption"]["background_over_fifo"],
            "resume_max_abs_diff": resume["same_batch"],
            "resume_max_abs_diff_rebatched": resume["rebatched"],
        },
    }


def table_priority(result: dict[str, Any]) -> str:
    """The urgent request's wait, and the background's cost, per mode."""
    rows = []
    for mode in MODES:
        p = result["peers"][mode]
        w = p["wait_steps"]
        rows.append(
            [
                mode,
                f"{int(w['n'])}",
                fmt(p["batch_step_ms"]["median"], 1),
                fmt(w["median"]),
                fmt(w["p99"]),
                fmt(p["wait_ms"]["median"], 1),
                fmt(p["background_over_fifo"], 3),
            ]
        )
    config = result["config"]
    summary = result["summary"]
    head = (
        f"A {config['short_steps']}-step urgent request arrives while {config['batch']} of"
        f" {config['background']} {config['long_steps']}-step background requests run"
        f" (tiny SD, {config['size']} px, batches of {config['batch']}). Wait: submission to"
        " the step boundary where the worker takes it, in the batch's steps. Target with"
        " preemption: p99 ≤ 1 step. Background: mean admission-to-last-step time of the"
        " background requests, over FIFO's. A suspended and resumed request against the same"
        f" request uninterrupted: max |diff| {summary['resume_max_abs_diff']:.3g} alone both"
        f" times, {summary['resume_max_abs_diff_rebatched']:.3g} resumed into another batch.\n\n"
    )
    return head + md_table(
        [
            "mode",
            "n",
            "batch step ms",
            "wait p50 steps",
            "wait p99 steps",
            "wait p50 ms",
            "background / fifo",
        ],
        rows,
    )


def plot_priority(result: dict[str, Any], path: Path) -> None:
    """Each trial's wait in steps, per mode (log scale)."""
    colors = {"fifo": "tab:gray", "priority": "tab:orange", "preemption": "tab:blue"}
    with figure(path, title="priority: an urgent request's wait behind background batches") as (
        ax,
    ):
        for i, mode in enumerate(MODES):
            values = result["peers"][mode]["samples_wait_steps"]
            ax.scatter([i] * len(values), values, color=colors[mode], alpha=0.6)
            ax.hlines(statistics.median(values), i - 0.25, i + 0.25, color="k")
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="target: 1 step")
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_yscale("log")
        ax.set_ylabel("wait, steps of the running batch")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
