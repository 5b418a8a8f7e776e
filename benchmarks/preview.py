"""``preview``: step time with a preview on every step, read by the consumer, vs none.

Tiny SD at 64 px, 20 steps, one request at a time; in both arms the consumer
iterates the handle's events, so the only difference is ``preview_every`` (1 vs
0). The step time is the request's execution time without its prompt encoding,
per step (``(exec_s - encode) / steps``): it holds the model calls, the previews
and the events' hand-off. The arms alternate. The runner's ``preview`` call alone
is timed too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from omni_trio import Engine, open_engine
from omni_trio.runners import DiffusersRunner

from .common import Options, fmt, md_table, shared_pipeline, spread
from .peers import sd_request
from .plot import PEER_COLORS, bar_with_range, figure

__all__ = ["plot_preview", "run_preview", "table_preview"]

SIZE = 64
STEPS = 20


async def _one(engine: Engine, preview_every: int, seed: int) -> dict[str, float]:
    request = sd_request(STEPS, SIZE, seed=seed, preview_every=preview_every)
    previews = 0
    started = time.perf_counter()
    async with engine.submit(request) as handle:
        async for event in handle:
            previews += event.preview is not None
        output = await handle.result()
    wall = time.perf_counter() - started
    metrics = output.metrics
    del output
    stages = metrics.stage_durations
    return {
        "step_s": (metrics.exec_s - stages["encode"]) / STEPS,
        "model_step_s": stages["denoise"] / STEPS,
        "wall_s": wall,
        "previews": float(previews),
    }


async def _measure(repeats: int) -> dict[str, list[dict[str, float]]]:
    runner = DiffusersRunner(shared_pipeline("sd"))
    arms: dict[str, list[dict[str, float]]] = {"off": [], "preview": []}
    async with open_engine(runner) as engine:
        await _one(engine, 1, seed=0)  # warm-up
        await _one(engine, 0, seed=0)
        for i in range(repeats):
            arms["off"].append(await _one(engine, 0, seed=i))
            arms["preview"].append(await _one(engine, 1, seed=i))
    return arms


def _runner_preview_us(repeats: int) -> float:
    runner = DiffusersRunner(shared_pipeline("sd"))
    state = runner.prepare(sd_request(STEPS, SIZE), "preview")
    runner.step([state])
    runner.preview(state)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        runner.preview(state)
    elapsed = time.perf_counter() - started
    runner.discard(state)
    return elapsed / repeats * 1e6


def run_preview(options: Options) -> dict[str, Any]:
    """Alternate requests with and without previews; compare their step times."""
    repeats = 3 if options.quick else 15
    arms = options.run(_measure, repeats)
    ratios = [p["step_s"] / o["step_s"] for p, o in zip(arms["preview"], arms["off"], strict=True)]
    wall_ratios = [
        p["wall_s"] / o["wall_s"] for p, o in zip(arms["preview"], arms["off"], strict=True)
    ]
    table = {
        arm: {key: spread([r[key] for r in runs]) for key in ("step_s", "model_step_s", "wall_s")}
        for arm, runs in arms.items()
    }
    runner_us = _runner_preview_us(200 if options.quick else 2000)
    return {
        "config": {
            "model": "tiny sd",
            "size": SIZE,
            "steps": STEPS,
            "repeats": repeats,
            "backend": options.backend,
        },
        "arms": table,
        "previews_per_request": arms["preview"][0]["previews"],
        "summary": {
            "step_time_ratio_preview_over_off": spread(ratios)["median"],
            "wall_ratio_preview_over_off": spread(wall_ratios)["median"],
            "runner_preview_us": runner_us,
            "step_ms_off": table["off"]["step_s"]["median"] * 1e3,
        },
    }


def table_preview(result: dict[str, Any]) -> str:
    """Step and request times of the two arms."""
    rows = []
    for arm, label in (("off", "previews off"), ("preview", "a preview every step, read")):
        a = result["arms"][arm]
        rows.append(
            [
                label,
                fmt(a["step_s"]["median"] * 1e3, 3),
                f"{fmt(a['step_s']['min'] * 1e3, 3)} - {fmt(a['step_s']['max'] * 1e3, 3)}",
                fmt(a["model_step_s"]["median"] * 1e3, 3),
                fmt(a["wall_s"]["median"] * 1e3, 1),
            ]
        )
    summary = result["summary"]
    config = result["config"]
    head = (
        f"Tiny SD, {config['size']} px, {config['steps']} steps, {config['repeats']} alternating"
        " repeats. Step time ratio preview / off:"
        f" {summary['step_time_ratio_preview_over_off']:.3f}"
        f" (target ≤ 1.05); the runner's preview call alone: {summary['runner_preview_us']:.0f} µs."
        "\n\n"
    )
    return head + md_table(
        ["arm", "step ms", "range", "model call ms (denoise stage)", "request ms"], rows
    )


def plot_preview(result: dict[str, Any], path: Path) -> None:
    """Step time per arm."""
    arms = result["arms"]
    with figure(path, title="preview: step time with previews read vs off") as (ax,):
        bar_with_range(
            ax,
            ["previews off", "preview every step"],
            [arms["off"]["step_s"], arms["preview"]["step_s"]],
            colors=[PEER_COLORS["raw"], PEER_COLORS["omni_trio"]],
            ylabel="ms per step",
            scale=1e3,
        )
