"""``devices``: throughput with 1, 2 and 4 workers in one engine, one shared queue.

Two runners:

- ``FakeRunner`` with sleeping steps (10 ms; a sleep releases the GIL, as a GPU
  kernel does): a burst of 48 five-step requests, batches of one, at 1, 2 and 4
  workers. What it measures is the engine's own scaling: placement, one queue,
  the threads. Target: N workers ≥ 0.9 x N times one worker's throughput.
- tiny SD at 256 px, 12 eight-step requests, batches of one, at 1 and 2 workers,
  torch with one intra-op thread per worker (on two cores the engine sets that
  itself; one worker gets ``torch_threads=1`` to match). Target on a two-core
  machine: 2 workers ≥ 1.5 x one. At 256 px the convolutions dominate a step; at
  64 px a step is mostly Python between small kernels, which holds the GIL, so two
  workers on two cores measured 0.95-1.05x one there, as any two Python threads would.
  (``--quick``: 64 px.)

Each configuration is timed from the first submit to the last output, over
``repeats`` rounds with the worker counts interleaved; the median is reported.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from omni_trio import EngineConfig, GenerationRequest, open_engine
from omni_trio.runners import DiffusersRunner
from omni_trio.testing import FakeRunner

from .common import Options, fmt, md_table, spread
from .plot import figure

__all__ = ["plot_devices", "run_devices", "table_devices"]

FAKE_WORKERS = (1, 2, 4)
SD_WORKERS = (1, 2)
FAKE_STEP_S = 0.01
#: Tiny SD's size in a full run: large enough that compute, not the GIL, bounds a step.
SD_SIZE = 256


def _fake_runner() -> Any:
    return FakeRunner(step_seconds=FAKE_STEP_S)


def _sd_runner() -> Any:
    # One pipeline per worker, as on separate devices: weights are not shared.
    from omni_trio.runners import tiny_pipeline

    return DiffusersRunner(tiny_pipeline("sd"))


async def _burst(runners: list[Any], requests: list[GenerationRequest]) -> float:
    """Seconds from the first submit to the last output, after a warm-up request."""
    config = EngineConfig(max_batch_size=1, torch_threads=1, max_waiting=len(requests) + 1)
    async with open_engine(runners, config) as engine:
        await engine.generate(requests[0])  # warm-up: first-call costs
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for request in requests:
                group.start_soon(engine.generate, request)
        return time.perf_counter() - started


async def _measure(
    repeats: int, fake_requests: int, sd_requests: int, sd_size: int
) -> dict[str, Any]:
    fake = [
        GenerationRequest(prompt="f", num_steps=5, height=16, width=16, seed=i)
        for i in range(fake_requests)
    ]
    sd = [
        GenerationRequest(prompt="a boat", num_steps=8, height=sd_size, width=sd_size, seed=i)
        for i in range(sd_requests)
    ]
    sd_runners = {n: [_sd_runner() for _ in range(n)] for n in SD_WORKERS}
    times: dict[str, dict[int, list[float]]] = {"fake": {}, "sd": {}}
    for _ in range(repeats):
        for n in FAKE_WORKERS:
            seconds = await _burst([_fake_runner() for _ in range(n)], fake)
            times["fake"].setdefault(n, []).append(seconds)
        for n in SD_WORKERS:
            seconds = await _burst(sd_runners[n], sd)
            times["sd"].setdefault(n, []).append(seconds)
    return {"times": times, "counts": {"fake": len(fake), "sd": len(sd)}, "sd_size": sd_size}


def run_devices(options: Options) -> dict[str, Any]:
    """Throughput at 1, 2 and 4 workers (FakeRunner) and 1 and 2 (tiny SD)."""
    repeats, fake_requests, sd_requests = (1, 8, 4) if options.quick else (5, 48, 12)
    sd_size = 64 if options.quick else SD_SIZE
    data = options.run(_measure, repeats, fake_requests, sd_requests, sd_size)
    peers: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for kind, workers in (("fake", FAKE_WORKERS), ("sd", SD_WORKERS)):
        count = data["counts"][kind]
        rows: dict[str, Any] = {}
        base = statistics.median(data["times"][kind][1])
        for n in workers:
            samples = data["times"][kind][n]
            median = statistics.median(samples)
            rows[str(n)] = {
                "seconds": spread(samples),
                "requests_per_s": count / median,
                "over_one_worker": base / median,
                "over_one_worker_per_worker": base / median / n,
            }
        peers[kind] = rows
        summary[f"{kind}_throughput_ratio"] = {n: row["over_one_worker"] for n, row in rows.items()}
    summary["fake_scaling_efficiency_4"] = peers["fake"]["4"]["over_one_worker_per_worker"]
    summary["sd_throughput_ratio_2_over_1"] = peers["sd"]["2"]["over_one_worker"]
    return {
        "config": {
            "fake_step_s": FAKE_STEP_S,
            "fake_requests": data["counts"]["fake"],
            "sd_requests": data["counts"]["sd"],
            "sd_size": data["sd_size"],
            "repeats": repeats,
            "backend": options.backend,
        },
        "peers": peers,
        "summary": summary,
    }


def table_devices(result: dict[str, Any]) -> str:
    """Throughput per worker count, and its ratio to one worker."""
    rows = []
    size = result["config"].get("sd_size", 64)
    labels = {"fake": "FakeRunner, 10 ms sleeping steps", "sd": f"tiny SD, {size} px"}
    for kind, label in labels.items():
        for n, row in result["peers"][kind].items():
            rows.append(
                [
                    label,
                    n,
                    fmt(row["seconds"]["median"], 3),
                    fmt(row["requests_per_s"], 1),
                    fmt(row["over_one_worker"], 2),
                    fmt(row["over_one_worker_per_worker"], 2),
                ]
            )
    config = result["config"]
    head = (
        f"A burst of {config['fake_requests']} five-step requests (FakeRunner) and of"
        f" {config['sd_requests']} eight-step requests (tiny SD), batches of one, one torch"
        " thread per worker; median of"
        f" {config['repeats']} rounds. Targets: FakeRunner N workers ≥ 0.9 x N; tiny SD"
        " 2 workers ≥ 1.5 x one on two cores.\n\n"
    )
    return head + md_table(
        ["runner", "workers", "burst s", "requests/s", "x one worker", "per worker"], rows
    )


def plot_devices(result: dict[str, Any], path: Path) -> None:
    """Throughput over one worker's, per worker count, with the ideal line."""
    with figure(path, title="devices: throughput over one worker's") as (ax,):
        for kind, color in (("fake", "tab:blue"), ("sd", "tab:orange")):
            rows = result["peers"][kind]
            ns = [int(n) for n in rows]
            ax.plot(
                ns, [rows[str(n)]["over_one_worker"] for n in ns], "o-", color=color, label=kind
            )
        ax.plot([1, 4], [1, 4], "k--", linewidth=1, label="ideal")
        ax.set_xlabel("workers")
        ax.set_ylabel("throughput / one worker's")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
