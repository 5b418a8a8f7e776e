"""``pipeline`` and ``batching``: the engine on a tiny real diffusers pipeline.

``pipeline``: one request at a time through the engine vs the pipeline's own
``__call__`` on the same inputs, interleaved (peer: the pipeline call).
``batching``: a burst of compatible requests at several ``max_batch_size``, and the
naive peer (every request a whole pipeline call behind one lock) on the same burst.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from omni_trio import EngineConfig, GenerationRequest, open_engine
from omni_trio.runners import DiffusersRunner

from .common import Options, fmt, md_table, p99, shared_pipeline, spread
from .peers import Call, LockedPipeline, call_kwargs, sd_request
from .plot import PEER_COLORS, bar_with_range, figure

__all__ = [
    "plot_batching",
    "plot_pipeline",
    "run_batching",
    "run_pipeline",
    "table_batching",
    "table_pipeline",
]

SIZE = 64


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _direct(pipe: Any, request: GenerationRequest, device: str) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        pipe(**call_kwargs(request)).images.cpu()
    _sync(device)
    return time.perf_counter() - started


async def _interleaved(
    pipe: Any, request: GenerationRequest, repeats: int, device: str
) -> dict[str, list[float]]:
    direct: list[float] = []
    engine_s: list[float] = []
    async with open_engine(DiffusersRunner(pipe)) as engine:
        await engine.generate(request)  # warm-up
        _direct(pipe, request, device)
        for _ in range(repeats):
            # The direct call blocks the loop's thread; the engine is idle meanwhile.
            direct.append(_direct(pipe, request, device))
            started = time.perf_counter()
            await engine.generate(request)
            engine_s.append(time.perf_counter() - started)
    return {"direct": direct, "engine": engine_s}


def run_pipeline(options: Options) -> dict[str, Any]:
    """Engine vs the pipeline's own call, one request at a time, interleaved."""
    steps, repeats = (4, 2) if options.quick else (20, 11)
    pipe = shared_pipeline(options.kind, options.device)
    request = sd_request(steps, SIZE)
    data = options.run(_interleaved, pipe, request, repeats, options.device)
    ratios = [e / d for e, d in zip(data["engine"], data["direct"], strict=True)]
    return {
        "config": {"kind": options.kind, "steps": steps, "size": SIZE, "repeats": repeats},
        "device": options.device,
        "direct_s": spread(data["direct"]),
        "engine_s": spread(data["engine"]),
        "summary": {"ratio_engine_over_pipeline": spread(ratios)["median"]},
    }


def table_pipeline(result: dict[str, Any]) -> str:
    """The two peers' times per request."""
    config = result["config"]
    rows = [
        [label, fmt(s["median"] * 1e3, 1), fmt(s["min"] * 1e3, 1), fmt(s["max"] * 1e3, 1)]
        for label, s in (
            ("pipeline's own call", result["direct_s"]),
            ("omni_trio", result["engine_s"]),
        )
    ]
    head = (
        f"Tiny {config['kind']}, {config['size']} px, {config['steps']} steps, {config['repeats']}"
        f" repeats on {result['device']}; engine / call ="
        f" {result['summary']['ratio_engine_over_pipeline']:.3f}.\n\n"
    )
    return head + md_table(["peer", "ms per request", "min", "max"], rows)


def plot_pipeline(result: dict[str, Any], path: Path) -> None:
    """Time per request, pipeline call vs engine."""
    with figure(path, title="pipeline: one request at a time") as (ax,):
        bar_with_range(
            ax,
            ["pipeline call", "omni_trio"],
            [result["direct_s"], result["engine_s"]],
            colors=[PEER_COLORS["naive"], PEER_COLORS["omni_trio"]],
            ylabel="ms per request",
            scale=1e3,
        )


async def _timed_burst(
    run_one: Callable[[int], Awaitable[object]], requests: int
) -> dict[str, float]:
    """Start ``requests`` calls of ``run_one(seed)`` at once; throughput and latency."""
    latencies: list[float] = []
    started = time.perf_counter()

    async def one(seed: int) -> None:
        begun = time.perf_counter()
        await run_one(seed)
        latencies.append(time.perf_counter() - begun)

    async with anyio.create_task_group() as group:
        for seed in range(requests):
            group.start_soon(one, seed)
    wall = time.perf_counter() - started
    return {
        "throughput_rps": requests / wall,
        "p50_s": statistics.median(latencies),
        "p99_s": p99(latencies),
    }


async def _burst(pipe: Any, requests: int, batch: int, steps: int) -> dict[str, float]:
    config = EngineConfig(max_batch_size=batch)
    async with open_engine(DiffusersRunner(pipe, max_batch_size=batch), config) as engine:
        await engine.generate(sd_request(2, SIZE))  # warm-up
        return await _timed_burst(
            lambda seed: engine.generate(sd_request(steps, SIZE, seed)), requests
        )


async def _naive_burst(pipe: Any, requests: int, steps: int) -> dict[str, float]:
    peer = LockedPipeline(pipe, interrupt=False)
    await peer.run(Call(sd_request(2, SIZE), observe=False))  # warm-up
    return await _timed_burst(
        lambda seed: peer.run(Call(sd_request(steps, SIZE, seed), observe=False)), requests
    )


def _burst_spread(results: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "throughput_rps": spread([r["throughput_rps"] for r in results]),
        "p50_s": spread([r["p50_s"] for r in results])["median"],
        "p99_s": spread([r["p99_s"] for r in results])["median"],
    }


def run_batching(options: Options) -> dict[str, Any]:
    """Throughput and latency of a burst of compatible requests at each batch size."""
    quick = options.quick
    requests = 8 if quick else options.requests
    batches = [1, 4] if quick else [1, 4, 8]
    steps, repeats = (4, 1) if quick else (10, 3)
    pipe = shared_pipeline(options.kind, options.device)
    runs: dict[str, list[dict[str, float]]] = {str(b): [] for b in batches}
    runs["naive"] = []
    for _ in range(repeats):
        for batch in batches:  # interleaved: drift hits every batch size alike
            runs[str(batch)].append(options.run(_burst, pipe, requests, batch, steps))
        runs["naive"].append(options.run(_naive_burst, pipe, requests, steps))
    table = {key: _burst_spread(results) for key, results in runs.items()}
    naive = table.pop("naive")
    rps = {key: value["throughput_rps"]["median"] for key, value in table.items()}
    summary = {
        "throughput_ratio_b4_over_b1": rps["4"] / rps["1"],
        "throughput_b1_rps": rps["1"],
        "throughput_naive_rps": naive["throughput_rps"]["median"],
    }
    if "8" in rps:
        summary["throughput_ratio_b8_over_b1"] = rps["8"] / rps["1"]
    return {
        "config": {
            "kind": options.kind,
            "requests": requests,
            "batches": batches,
            "steps": steps,
            "size": SIZE,
            "repeats": repeats,
            "backend": options.backend,
        },
        "device": options.device,
        "batches": table,
        "naive": naive,
        "summary": summary,
    }


def table_batching(result: dict[str, Any]) -> str:
    """Throughput and latency per batch size, and the naive peer."""
    base = result["batches"]["1"]["throughput_rps"]["median"]
    rows = []
    entries = [(f"omni_trio, max_batch_size {b}", v) for b, v in result["batches"].items()]
    entries.append(("naive (one call at a time)", result["naive"]))
    for label, value in entries:
        rps = value["throughput_rps"]
        rows.append(
            [
                label,
                fmt(rps["median"], 2),
                fmt(rps["min"], 2),
                fmt(rps["max"], 2),
                f"{rps['median'] / base:.2f}x",
                fmt(value["p50_s"] * 1e3, 0),
                fmt(value["p99_s"] * 1e3, 0),
            ]
        )
    config = result["config"]
    head = (
        f"{config['requests']} concurrent requests, tiny {config['kind']}, {config['size']} px,"
        f" {config['steps']} steps, {config['repeats']} repeats on {result['device']}.\n\n"
    )
    return head + md_table(
        ["peer", "req/s", "min", "max", "vs batch 1", "p50 latency ms", "p99 latency ms"], rows
    )


def plot_batching(result: dict[str, Any], path: Path) -> None:
    """Throughput and latency per batch size."""
    keys = list(result["batches"])
    labels = [f"batch {k}" for k in keys] + ["naive"]
    values = [result["batches"][k] for k in keys] + [result["naive"]]
    colors = [PEER_COLORS["omni_trio"]] * len(keys) + [PEER_COLORS["naive"]]
    with figure(path, columns=2, title="batching: a burst of compatible requests") as (a, b):
        bar_with_range(
            a, labels, [v["throughput_rps"] for v in values], colors=colors, ylabel="requests/s"
        )
        x = range(len(labels))
        b.bar(
            [i - 0.2 for i in x],
            [v["p50_s"] * 1e3 for v in values],
            width=0.4,
            label="p50",
            color=colors,
        )
        b.bar(
            [i + 0.2 for i in x],
            [v["p99_s"] * 1e3 for v in values],
            width=0.4,
            label="p99",
            color=colors,
            alpha=0.5,
        )
        b.set_xticks(list(x), labels)
        b.set_ylabel("latency, ms")
        b.legend(fontsize=8)
        b.grid(axis="y", alpha=0.3)
