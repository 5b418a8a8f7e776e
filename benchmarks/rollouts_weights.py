"""``rollouts``' second half: weights in place (L102), sleep and wake (L103).

On the same compute-bound Flux (``bench_flux``, built anew: an update writes into its
tensors), with the rollouts' requests (the SDE sampler, trajectories kept):

- **updates**: the transformer's whole state dict, a perturbed copy and the original in
  turn (each update changes every value), through ``Engine.update_weights``: with
  nothing in flight; with ``GROUP`` samples in flight, called after their ``AT``-th
  step, under ``policy="finish"`` (how long the update waited for them, what applying
  took, and whether their steps went on: the largest gap between two consecutive step
  ends of theirs, as the worker's runner saw them, from the last step before the call
  to the update's return, over the median gap of the run; the steps they lost;
  whether one ran on the new weights) and under ``"abort"`` (until the call returned;
  how many were aborted). ``REPEATS`` times each, interleaved; medians.
- **sleep and wake**: the model saved to a folder and loaded from it (so level 2 has
  files to drop weights to), one request before, then ``REPEATS`` times at each level
  a sleep, a wake, and the same request again: its images and trajectory against the
  ones from before, bitwise (the count of those that differ: target 0).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import omni_trio as ot

from .cache import bench_flux
from .common import fmt, md_table, spread
from .peers import TimedRunner

__all__ = ["run_weights", "table_weights"]

#: Samples in flight when an update comes (as the rollouts' groups).
GROUP = 8
#: Their steps, and the step after which the update is called: 4 steps run during it.
STEPS = 6
AT = 2
#: Repetitions of each update and of each level's sleep: the phase takes ~40 s here.
REPEATS = 5
#: The steps of the request compared across a sleep.
SLEEP_STEPS = 4
#: Standard deviation of the noise added to every weight for the perturbed copy.
PERTURBATION = 1e-3


def _sources(pipe: Any) -> list[dict[str, Any]]:
    """The transformer's state dict perturbed, and as it is (copies both)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    original = {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}
    perturbed = {
        k: v + PERTURBATION * torch.randn(v.shape, generator=generator, dtype=v.dtype)
        for k, v in original.items()
    }
    return [perturbed, original]


def _stall(steps: list[tuple[float, float]], called: float, returned: float) -> tuple[float, float]:
    """The largest gap between consecutive step ends around ``[called, returned]`` (from
    the last end before the call), and the median gap of them all, in seconds."""
    pairs = list(itertools.pairwise(ended for _, ended in steps))
    during = [b - a for a, b in pairs if b > called and a < returned]
    # One step alone (an abort after the first): its duration stands for a gap.
    gaps = [b - a for a, b in pairs] or [ended - begun for begun, ended in steps]
    return max(during, default=0.0), statistics.median(gaps)


async def _in_flight(
    engine: ot.Engine,
    runner: TimedRunner,
    requests: list[ot.GenerationRequest],
    source: dict[str, Any],
    policy: Any,
    at: int,
) -> dict[str, float]:
    """Submit ``requests``; once each did ``at`` steps, update under ``policy``."""
    import anyio

    first, old = len(runner.steps), engine.weight_version
    ended: list[float] = []
    mixed = reached = 0
    ready = anyio.Event()
    async with AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(engine.submit(r)) for r in requests]

        async def follow(handle: ot.RequestHandle) -> None:
            nonlocal mixed, reached
            counted = False
            async for event in handle:
                if event.step >= at and not counted:
                    counted, reached = True, reached + 1
                    if reached == len(handles):
                        ready.set()
            try:
                output = await handle.result()
            except ot.RequestAbortedError:
                pass
            else:
                mixed += output.weight_version != old
            ended.append(time.perf_counter())

        async with anyio.create_task_group() as tasks:
            for handle in handles:
                tasks.start_soon(follow, handle)
            await ready.wait()
            called = time.perf_counter()
            await engine.update_weights(source, policy=policy)
            returned = time.perf_counter()
        done = [handle.metrics.steps_done if handle.metrics else 0 for handle in handles]
        aborted = [handle.abort_reason == ot.AbortReason.WEIGHTS_UPDATED for handle in handles]
    largest, median_step = _stall(runner.steps[first:], called, returned)
    # Until the last of them ended (the update waits for their release, then applies).
    waited = min(max(ended), returned) - called
    return {
        "latency_s": returned - called,
        "waited_s": waited,
        "applying_s": returned - called - waited,
        "max_gap_steps": largest / median_step,
        "steps_lost": float(sum(r.num_steps - d for r, d in zip(requests, done, strict=True))),
        "mixed_versions": float(mixed),
        "aborted": float(sum(aborted)),
        "in_flight": float(len(requests)),
        "median_step_s": median_step,
    }


async def _updates(
    pipe: Any, request: ot.GenerationRequest, group: int, at: int, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """Each kind of update ``repeats`` times, interleaved, on one engine."""
    assert request.seed is not None
    requests = [replace(request, seed=seed) for seed in ot.group_seeds(request.seed, group)]
    sources = _sources(pipe)
    runner = TimedRunner(pipe, max_batch_size=group)
    out: dict[str, list[dict[str, float]]] = {"idle": [], "finish": [], "abort": []}
    config = ot.EngineConfig(max_batch_size=group, max_waiting=2 * group)
    async with ot.open_engine(runner, config) as engine:
        await engine.generate(request)  # warm-up
        for turn in range(3 * repeats):
            kind, source = ("idle", "finish", "abort")[turn % 3], sources[turn % 2]
            if kind == "idle":
                called = time.perf_counter()
                await engine.update_weights(source)
                out[kind].append({"latency_s": time.perf_counter() - called})
            else:
                out[kind].append(await _in_flight(engine, runner, requests, source, kind, at))
    return out


def _same(one: ot.GenerationOutput, other: ot.GenerationOutput) -> bool:
    """The same images and trajectory, bitwise."""
    import torch

    a, b = one.trajectory, other.trajectory
    assert a is not None and b is not None
    return torch.equal(one.images, other.images) and all(
        torch.equal(getattr(a, name), getattr(b, name))
        for name in ("latents", "noise", "log_probs")
    )


async def _sleeps(
    runner: Any, request: ot.GenerationRequest, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """Sleep and wake at each level ``repeats`` times; the same request after each wake."""
    out: dict[str, list[dict[str, float]]] = {"1": [], "2": []}
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
        await engine.generate(request)  # warm-up
        before = await engine.generate(request)
        for _ in range(repeats):
            for level in (1, 2):
                report = await engine.sleep(level)
                woke = await engine.wake()
                after = await engine.generate(request)
                out[str(level)].append(
                    {
                        "sleep_s": report.sleep_s,
                        "drain_s": report.drain_s,
                        "wake_s": woke.wake_s,
                        "offloaded_bytes": float(report.offloaded_bytes),
                        "dropped_bytes": float(report.dropped_bytes),
                        "mismatch": float(not _same(after, before)),
                    }
                )
    return out


def _medians(trials: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(t[key] for t in trials) for key in trials[0]}


def run_weights(run: Any, request: ot.GenerationRequest, *, quick: bool) -> dict[str, Any]:
    """Both phases; ``run`` starts an event loop (``Options.run``), ``request`` is a
    rollout's (its steps and seed are replaced)."""
    from omni_trio.runners import load
    from omni_trio.runners._quiet import quiet_notices

    group, steps, at, repeats = (2, 3, 1, 1) if quick else (GROUP, STEPS, AT, REPEATS)
    sleep_request = replace(request, num_steps=2 if quick else SLEEP_STEPS)
    pipe = bench_flux()  # its own: the updates write into its tensors
    state_bytes = sum(v.nbytes for v in pipe.transformer.state_dict().values())
    with tempfile.TemporaryDirectory(prefix="rollouts-") as folder:
        with quiet_notices():  # no "Writing model shards" bar
            pipe.save_pretrained(folder)
        updates = run(_updates, pipe, replace(request, num_steps=steps), group, at, repeats)
        sleeps = run(_sleeps, load(folder), sleep_request, repeats)
    finish, abort = _medians(updates["finish"]), _medians(updates["abort"])
    levels = {level: _medians(trials) for level, trials in sleeps.items()}
    ms = 1e3
    summary = {
        "update_idle_ms": statistics.median(t["latency_s"] for t in updates["idle"]) * ms,
        "update_finish_ms": finish["latency_s"] * ms,
        "update_finish_waited_ms": finish["waited_s"] * ms,
        "update_finish_applying_ms": finish["applying_s"] * ms,
        # The worst repetition: a stall in any one of them counts.
        "update_finish_max_gap_steps": max(t["max_gap_steps"] for t in updates["finish"]),
        "update_finish_steps_lost": sum(t["steps_lost"] for t in updates["finish"]),
        "update_finish_mixed_versions": sum(t["mixed_versions"] for t in updates["finish"]),
        "update_abort_ms": abort["latency_s"] * ms,
        # In the finish runs' steps: the same samples, the same batch.
        "update_abort_steps": abort["latency_s"] / finish["median_step_s"],
        "update_abort_aborted": sum(t["aborted"] for t in updates["abort"]),
        "update_abort_in_flight": sum(t["in_flight"] for t in updates["abort"]),
        "wake_output_mismatches": sum(t["mismatch"] for ts in sleeps.values() for t in ts),
    }
    for level, medians in levels.items():
        summary[f"sleep{level}_ms"] = medians["sleep_s"] * ms
        summary[f"wake{level}_ms"] = medians["wake_s"] * ms
        summary[f"sleep{level}_offloaded_bytes"] = medians["offloaded_bytes"]
        summary[f"sleep{level}_dropped_bytes"] = medians["dropped_bytes"]
    return {
        "config": {
            "group": group,
            "steps": steps,
            "at": at,
            "repeats": repeats,
            "sleep_steps": sleep_request.num_steps,
            "state_dict_bytes": state_bytes,
            "perturbation": PERTURBATION,
        },
        "updates": {
            kind: {key: spread([t[key] for t in trials]) for key in trials[0]}
            for kind, trials in updates.items()
        },
        "sleeps": {
            level: {key: spread([t[key] for t in trials]) for key in trials[0]}
            for level, trials in sleeps.items()
        },
        "mismatches": {level: sum(t["mismatch"] for t in ts) for level, ts in sleeps.items()},
        "summary": summary,
    }


def table_weights(weights: dict[str, Any]) -> str:
    """The updates' latencies and the running samples' stall; sleep and wake."""
    config, s, updates = weights["config"], weights["summary"], weights["updates"]
    g = config["group"]

    def row(kind: str, label: str) -> list[str]:
        figures = updates[kind]
        latency = figures["latency_s"]
        return [
            label,
            *(fmt(latency[key] * 1e3, 1) for key in ("median", "min", "max")),
            *(
                fmt(figures[key]["median"] * 1e3, 1) if key in figures else "-"
                for key in ("waited_s", "applying_s")
            ),
        ]

    level_rows = [
        [
            level,
            fmt(levels["sleep_s"]["median"] * 1e3, 1),
            fmt(levels["wake_s"]["median"] * 1e3, 1),
            f"{levels['offloaded_bytes']['median']:,.0f}",
            f"{levels['dropped_bytes']['median']:,.0f}",
            f"{weights['mismatches'][level]:.0f}",
        ]
        for level, levels in weights["sleeps"].items()
    ]
    return "\n".join(
        [
            "\n**Weights in place** (L102): the transformer's whole state dict"
            f" ({config['state_dict_bytes']:,} bytes; a perturbed copy and the original in"
            f" turn) through `update_weights`; {g} samples of {config['steps']} steps in"
            f" flight, the update called after their step {config['at']}; medians of"
            f" {config['repeats']}, ms:\n",
            md_table(
                ["update", "call to return", "min", "max", "waiting for them", "applying"],
                [
                    row("idle", "nothing in flight"),
                    row("finish", f"{g} samples in flight, finish"),
                    row("abort", f"{g} samples in flight, abort"),
                ],
            ),
            "\nUnder finish the running samples step on: the largest gap between two of"
            " their consecutive steps during the update was"
            f" {s['update_finish_max_gap_steps']:.2f} median steps (the worst repetition);"
            f" steps lost {s['update_finish_steps_lost']:.0f}, samples on the new weights"
            f" {s['update_finish_mixed_versions']:.0f}. Under abort the call returned after"
            f" {s['update_abort_steps']:.2f} median steps, {s['update_abort_aborted']:.0f} of"
            f" {s['update_abort_in_flight']:.0f} samples aborted (`weights_updated`).\n",
            "\n**Sleep and wake** (L103): the model loaded from a folder (level 2 drops what"
            f" its files hold); medians of {config['repeats']} per level, each followed by a"
            f" request of {config['sleep_steps']} steps compared with the same one before the"
            " sleeps:\n",
            md_table(
                ["level", "sleep ms", "wake ms", "offloaded bytes", "dropped bytes", "differing"],
                level_rows,
            ),
            "\nDiffering: the outputs after a wake whose images or trajectory differ from the"
            " one before, bitwise (target 0).",
        ]
    )
