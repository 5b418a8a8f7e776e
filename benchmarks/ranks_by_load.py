"""``ranks``' split-by-load regimes: one group that splits tokens or rows by the batch.

Three arms, each through an engine of batches up to ``DEEP`` requests, in rounds:
each round starts each arm in turn (a process holds one group at a time), so slow
drift of the machine's load reaches every arm alike:

- ``by_load``: two gloo ranks, Ulysses, ``by_load=True``: a call with fewer rows than
  ranks splits its tokens, a call with a row per rank or more splits its rows;
- ``tokens``: the same two ranks, Ulysses always (the split the peers run);
- ``one_rank``: ``DiffusersRunner`` in this process, two torch threads (the same two
  cores the ranks share).

Regimes, each repeat in turn after a warm-up: *alone*, one request's latency on an
idle engine (the short queue); *deep*, ``2 * DEEP`` requests submitted at once, their
throughput (requests per second: the deep queue). The model calls each way that each
group made, summed over its rounds, are its ``calls()``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from typing import Any

import anyio
import torch

from omni_trio import EngineConfig, GenerationRequest, open_engine
from omni_trio.parallel import ParallelRunner
from omni_trio.runners import DiffusersRunner, tiny_pipeline

from .common import Options, shared_pipeline, spread

__all__ = ["ARMS", "run_by_load"]

#: The arms, in the order they run.
ARMS = ("by_load", "tokens", "one_rank")
#: The most requests per batch; the deep regime submits twice as many.
DEEP = 4


class Lent:
    """The runner lent to one engine: the benchmark closes it after its report."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def close(self) -> None:
        return None


async def _regimes(runner: Any, request: GenerationRequest, repeats: int) -> dict[str, list[float]]:
    """Alone latency and deep throughput, ``repeats`` of each, on one engine."""
    requests = [dataclasses.replace(request, seed=5 + i) for i in range(2 * DEEP)]
    alone: list[float] = []
    deep: list[float] = []
    async with open_engine(Lent(runner), EngineConfig(max_batch_size=DEEP)) as engine:
        await engine.generate(request)  # a warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            await engine.generate(request)
            alone.append(time.perf_counter() - started)
            started = time.perf_counter()
            async with anyio.create_task_group() as group:
                for each in requests:
                    group.start_soon(engine.generate, each)
            deep.append(len(requests) / (time.perf_counter() - started))
    return {"alone_s": alone, "deep_per_s": deep}


def _round(arm: str, request: GenerationRequest, options: Options, repeats: int) -> dict[str, Any]:
    """One round of ``arm``: its runner started, measured and closed."""
    if arm == "one_rank":
        torch.set_num_threads(2)
        runner: Any = DiffusersRunner(shared_pipeline("flux"))
        try:
            return options.run(_regimes, runner, request, repeats)
        finally:
            runner.close()
    group = ParallelRunner(
        functools.partial(tiny_pipeline, "flux"),
        ulysses=2,
        by_load=arm == "by_load",
        torch_threads=1,
    )
    try:
        figures: dict[str, Any] = options.run(_regimes, group, request, repeats)
        return {**figures, "calls": group.calls()}
    finally:
        group.close()


def run_by_load(options: Options) -> dict[str, Any]:
    """Each arm in turn, round after round, both regimes; ratios of the by-load arm
    over the others (of medians over every round's repeats)."""
    size, steps, rounds, repeats = (64, 3, 1, 1) if options.quick else (512, 10, 4, 2)
    request = GenerationRequest(
        prompt="a lighthouse at dusk", num_steps=steps, height=size, width=size, seed=5
    )
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"alone_s": [], "deep_per_s": []} for arm in ARMS
    }
    calls: dict[str, Counter[str]] = {}
    threads = torch.get_num_threads()
    try:
        for _ in range(rounds):
            for arm in ARMS:
                figures = _round(arm, request, options, repeats)
                for key, values in samples[arm].items():
                    values += figures[key]
                if "calls" in figures:
                    calls.setdefault(arm, Counter()).update(figures["calls"])
    finally:
        torch.set_num_threads(threads)
    arms: dict[str, dict[str, Any]] = {
        arm: {
            **{key: spread(values) for key, values in samples[arm].items()},
            **({"calls": dict(calls[arm])} if arm in calls else {}),
        }
        for arm in ARMS
    }
    alone = {arm: figures["alone_s"]["median"] for arm, figures in arms.items()}
    deep = {arm: figures["deep_per_s"]["median"] for arm, figures in arms.items()}
    return {
        "model": "tiny flux",
        "size": size,
        "steps": steps,
        "deep": 2 * DEEP,
        "max_batch_size": DEEP,
        "rounds": rounds,
        "repeats": repeats,
        "arms": arms,
        "alone_ratio_over_tokens": alone["by_load"] / alone["tokens"],
        "alone_ratio_over_one_rank": alone["by_load"] / alone["one_rank"],
        "deep_ratio_over_tokens": deep["by_load"] / deep["tokens"],
        "deep_ratio_over_one_rank": deep["by_load"] / deep["one_rank"],
    }
