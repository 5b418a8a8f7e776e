"""``pipeline`` and ``batching``: the engine on a tiny real diffusers pipeline.

``pipeline``: one request at a time through the engine vs the pipeline's own
``__call__`` on the same inputs, interleaved (peer: the pipeline call).
``batching``: N concurrent compatible requests at several ``max_batch_size``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import torch

from .._config import EngineConfig, GenerationRequest
from .._engine import open_engine
from ..runners import DiffusersRunner, tiny_pipeline
from ._common import percentile, spread

__all__ = ["run_batching", "run_pipeline"]


def _request(steps: int, size: int, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        prompt="a lighthouse", num_steps=steps, height=size, width=size, seed=seed
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _direct(pipe: Any, request: GenerationRequest, device: str) -> float:
    started = time.perf_counter()
    pipe(
        request.prompt,
        num_inference_steps=request.num_steps,
        height=request.height,
        width=request.width,
        guidance_scale=request.guidance_scale,
        generator=torch.Generator().manual_seed(request.seed or 0),
        output_type="pt",
    ).images.cpu()
    _sync(device)
    return time.perf_counter() - started


async def _engine_sequential(pipe: Any, request: GenerationRequest, repeats: int) -> list[float]:
    times: list[float] = []
    async with open_engine(DiffusersRunner(pipe)) as engine:
        await engine.generate(request)  # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            await engine.generate(request)
            times.append(time.perf_counter() - started)
    return times


def run_pipeline(*, kind: str, steps: int, size: int, repeats: int, device: str) -> dict[str, Any]:
    """Engine vs the pipeline's own call, one request at a time, interleaved."""
    pipe: Any = tiny_pipeline(kind).to(device)
    request = _request(steps, size)
    _direct(pipe, request, device)  # warm-up
    direct: list[float] = []
    engine: list[float] = []
    for _ in range(repeats):
        direct.append(_direct(pipe, request, device))
        engine.extend(anyio.run(_engine_sequential, pipe, request, 1))
    ratios = [e / d for e, d in zip(engine, direct, strict=True)]
    return {
        "config": {"kind": kind, "steps": steps, "size": size, "repeats": repeats},
        "device": device,
        "direct_s": spread(direct),
        "engine_s": spread(engine),
        "summary": {"ratio_engine_over_pipeline": spread(ratios)["median"]},
    }


async def _burst(pipe: Any, requests: int, batch: int, steps: int, size: int) -> dict[str, Any]:
    latencies: list[float] = []
    config = EngineConfig(max_batch_size=batch)
    async with open_engine(DiffusersRunner(pipe, max_batch_size=batch), config) as engine:
        await engine.generate(_request(2, size))  # warm-up
        started = time.perf_counter()

        async def one(seed: int) -> None:
            begun = time.perf_counter()
            await engine.generate(_request(steps, size, seed))
            latencies.append(time.perf_counter() - begun)

        async with anyio.create_task_group() as tg:
            for seed in range(requests):
                tg.start_soon(one, seed)
        wall = time.perf_counter() - started
    return {
        "throughput_rps": requests / wall,
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
    }


def run_batching(
    *,
    kind: str,
    requests: int,
    batches: list[int],
    steps: int,
    size: int,
    repeats: int,
    device: str,
) -> dict[str, Any]:
    """Throughput and latency of a burst of compatible requests at each batch size."""
    pipe: Any = tiny_pipeline(kind).to(device)
    runs: dict[int, list[dict[str, Any]]] = {batch: [] for batch in batches}
    for _ in range(repeats):
        for batch in batches:  # interleaved: drift hits every batch size alike
            runs[batch].append(anyio.run(_burst, pipe, requests, batch, steps, size))
    throughput = {
        batch: spread([r["throughput_rps"] for r in results]) for batch, results in runs.items()
    }
    table = {
        str(batch): {
            "throughput_rps": throughput[batch],
            "p50_s": spread([r["p50_s"] for r in results])["median"],
            "p99_s": spread([r["p99_s"] for r in results])["median"],
        }
        for batch, results in runs.items()
    }
    summary: dict[str, float] = {}
    if 1 in throughput and 4 in throughput:
        summary["throughput_ratio_b4_over_b1"] = throughput[4]["median"] / throughput[1]["median"]
    return {
        "config": {
            "kind": kind,
            "requests": requests,
            "batches": batches,
            "steps": steps,
            "size": size,
            "repeats": repeats,
        },
        "device": device,
        "batches": table,
        "summary": summary,
    }
