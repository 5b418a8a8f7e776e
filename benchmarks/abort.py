"""``abort``: from the abort call to the worker's release, running and waiting requests.

Tiny SD, 64 px, 20 steps, one request at a time. A request is aborted at a random
step *and* at a random point inside that step (the step event arrives as the next
step starts; the abort waits a uniform fraction of a step after it). For omni_trio
the time is that of ``await engine.abort(id)``, which returns once the worker has
released the request; for the peers it runs from the abort to the moment the
pipeline thread lets the lock go (the naive caller itself returns at once: its
thread runs on). A second request waiting behind the running one is aborted too:
that is the waiting-abort time. The runner notes when each step starts and ends,
so each running abort is also compared with the step that was in progress when
it came: on a shared machine a step can take twice its median, and no abort can
land inside a step.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import anyio

from omni_trio import EngineConfig, open_engine
from omni_trio.runners import DiffusersRunner

from .common import Options, fmt, md_table, shared_pipeline, spread_p99
from .peers import (
    Call,
    LockedPipeline,
    TimedRunner,
    median_step_s,
    sd_request,
    start_call,
    step_in_progress,
)
from .plot import PEER_COLORS, figure

__all__ = ["plot_abort", "run_abort", "table_abort"]

SIZE = 64
STEPS = 20
#: The slack the running-abort target allows over one step, in milliseconds (targets.py).
TARGET_SLACK_MS = 2.0


async def _engine_trials(trials: int, step_s: float, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    pipe = shared_pipeline("sd")
    runner = TimedRunner(pipe)
    out: dict[str, list[float]] = {
        "running_s": [],
        "release_s": [],
        "waiting_s": [],
        "in_progress_s": [],
        "after_boundary_s": [],
    }
    async with open_engine(runner, EngineConfig(max_batch_size=1)) as engine:
        await engine.generate(sd_request(2, SIZE))  # warm-up
        for i in range(trials):
            at = rng.randint(1, STEPS - 4)
            request = sd_request(STEPS, SIZE, seed=i)
            async with engine.submit(request, request_id="running") as handle:
                async for event in handle:
                    if event.step >= at:
                        break
                # A second request waits behind the running one (batch size 1).
                async with engine.submit(request, request_id="waiting"):
                    started = time.perf_counter()
                    await engine.abort("waiting")
                    out["waiting_s"].append(time.perf_counter() - started)
                await anyio.sleep(rng.random() * step_s)
                started = time.perf_counter()
                await engine.abort("running")
                returned = time.perf_counter()
                out["running_s"].append(returned - started)
                assert handle.metrics is not None and handle.metrics.abort_latency_s is not None
                out["release_s"].append(handle.metrics.abort_latency_s)
                in_progress, boundary = step_in_progress(runner.steps, started)
                out["in_progress_s"].append(in_progress)
                out["after_boundary_s"].append(returned - boundary)
    steps = [ended - begun for begun, ended in runner.steps]
    out["step_s"] = steps
    return out


async def _peer_trials(
    peer: LockedPipeline, trials: int, step_s: float, seed: int
) -> dict[str, list[float]]:
    rng = random.Random(seed)
    out: dict[str, list[float]] = {"release_s": [], "caller_s": []}
    await peer.run(Call(sd_request(2, SIZE)))  # warm-up
    for i in range(trials):
        at = rng.randint(1, STEPS - 4)
        call = Call(sd_request(STEPS, SIZE, seed=i))
        async with anyio.create_task_group() as group:
            scope = start_call(group, peer, call)
            await peer.wait_steps(call, at)
            await anyio.sleep(rng.random() * step_s)
            aborted = time.perf_counter()
            peer.abort(call, scope)
        out["caller_s"].append(time.perf_counter() - aborted)
        await peer.wait_ended(call)
        assert call.t_end is not None
        out["release_s"].append(call.t_end - aborted)
    return out


async def _measure(trials: int, peer_trials: int, step_s: float) -> dict[str, Any]:
    pipe = shared_pipeline("sd")
    engine = await _engine_trials(trials, step_s, seed=0)
    peers = {}
    for interrupt in (False, True):
        peer = LockedPipeline(pipe, interrupt=interrupt)
        peers[peer.name] = await _peer_trials(peer, peer_trials, step_s, seed=1)
        await peer.wait_idle()
    return {"omni_trio": engine, **peers}


def run_abort(options: Options) -> dict[str, Any]:
    """Abort requests at random points; time the release, in ms and in steps."""
    trials, peer_trials = (8, 2) if options.quick else (200, 12)
    step_s = median_step_s(DiffusersRunner(shared_pipeline("sd")), sd_request(STEPS, SIZE))
    data = options.run(_measure, trials, peer_trials, step_s)
    engine = data["omni_trio"]

    def ms(values: list[float]) -> dict[str, float]:
        return spread_p99([v * 1e3 for v in values])

    def steps(values: list[float]) -> dict[str, float]:
        return spread_p99([v / step_s for v in values])

    running_ms = ms(engine["running_s"])
    waiting_ms = ms(engine["waiting_s"])
    step_ms = step_s * 1e3
    # Each abort against the step that was running when it came: what the engine adds.
    over_step_ms = ms(
        [r - p for r, p in zip(engine["running_s"], engine["in_progress_s"], strict=True)]
    )
    after_boundary_ms = ms(engine["after_boundary_s"])
    engine_steps_ms = ms(engine["step_s"])
    peers = {
        name: {
            "release_ms": ms(data[name]["release_s"]),
            "release_steps": steps(data[name]["release_s"]),
            "caller_returned_ms": ms(data[name]["caller_s"]),
        }
        for name in ("naive", "interrupt")
    }
    return {
        "config": {
            "model": "tiny sd",
            "size": SIZE,
            "steps": STEPS,
            "trials": trials,
            "peer_trials": peer_trials,
            "backend": options.backend,
        },
        "step_ms": step_ms,
        "omni_trio": {
            "running_ms": running_ms,
            "running_steps": steps(engine["running_s"]),
            "worker_release_ms": ms(engine["release_s"]),
            "waiting_ms": waiting_ms,
            "over_step_in_progress_ms": over_step_ms,
            "after_boundary_ms": after_boundary_ms,
            "step_in_progress_ms": ms(engine["in_progress_s"]),
            "all_steps_ms": engine_steps_ms,
        },
        "peers": peers,
        "samples_ms": {
            "omni_trio": [v * 1e3 for v in engine["running_s"]],
            "waiting": [v * 1e3 for v in engine["waiting_s"]],
            **{name: [v * 1e3 for v in data[name]["release_s"]] for name in peers},
        },
        "summary": {
            "running_p99_steps": running_ms["p99"] / step_ms,
            "waiting_p99_ms": waiting_ms["p99"],
            "running_p99_ms": running_ms["p99"],
            "running_p50_ms": running_ms["median"],
            "running_target_ms": step_ms + TARGET_SLACK_MS,
            "step_ms": step_ms,
            "running_p99_ms_over_step_in_progress": over_step_ms["p99"],
            "after_boundary_p99_ms": after_boundary_ms["p99"],
            "engine_step_p99_ms": engine_steps_ms["p99"],
            "naive_release_p50_steps": peers["naive"]["release_steps"]["median"],
            "interrupt_release_p50_steps": peers["interrupt"]["release_steps"]["median"],
        },
    }


def table_abort(result: dict[str, Any]) -> str:
    """Release times per peer, in milliseconds and steps."""
    step_ms = result["step_ms"]
    engine = result["omni_trio"]
    rows = []

    def row(label: str, s: dict[str, float]) -> list[str]:
        return [
            label,
            f"{int(s['n'])}",
            fmt(s["median"]),
            fmt(s["p99"]),
            fmt(s["max"]),
            fmt(s["median"] / step_ms),
            fmt(s["p99"] / step_ms),
        ]

    rows.append(row("omni_trio, running", engine["running_ms"]))
    rows.append(
        row("omni_trio, running, minus the step in progress", engine["over_step_in_progress_ms"])
    )
    rows.append(row("omni_trio, running, after the step boundary", engine["after_boundary_ms"]))
    rows.append(row("omni_trio, waiting", engine["waiting_ms"]))
    rows.append(row("(every engine step, for scale)", engine["all_steps_ms"]))
    rows.extend(
        row(f"{name}, running (until the thread lets go)", result["peers"][name]["release_ms"])
        for name in ("naive", "interrupt")
    )
    config = result["config"]
    head = (
        f"Tiny SD, {config['size']} px, {config['steps']} steps of {step_ms:.2f} ms; aborted at a"
        " random step and a random point inside it. Target for running: p99 ≤ 1 step + 2 ms ="
        f' {step_ms + TARGET_SLACK_MS:.2f} ms; for waiting: p99 ≤ 1 ms. "Minus the step in'
        ' progress" subtracts, per abort, the duration of the step that was running when the'
        ' abort came (a step cannot be cut); "after the step boundary" runs from that step\'s'
        " end to the abort call's return. The naive caller returns after"
        f" {fmt(result['peers']['naive']['caller_returned_ms']['median'])} ms (median) while its"
        " thread runs on.\n\n"
    )
    return head + md_table(
        ["peer, request", "n", "p50 ms", "p99 ms", "max ms", "p50 steps", "p99 steps"], rows
    )


def plot_abort(result: dict[str, Any], path: Path) -> None:
    """Release times per peer (steps, log scale); omni_trio's running and waiting CDFs."""
    step_ms = result["step_ms"]
    samples = result["samples_ms"]
    peers = ["naive", "interrupt", "omni_trio"]
    with figure(path, columns=2, title="abort: from the abort to the worker's release") as (
        left,
        right,
    ):
        data = [[v / step_ms for v in samples[p]] for p in peers]
        parts = left.boxplot(data, patch_artist=True)
        left.set_xticks(range(1, len(peers) + 1), peers)
        for patch, peer in zip(parts["boxes"], peers, strict=True):
            patch.set_facecolor(PEER_COLORS[peer])
        left.set_yscale("log")
        left.set_ylabel("release time, steps")
        left.axhline(1 + TARGET_SLACK_MS / step_ms, color="k", linestyle="--", linewidth=1)
        left.grid(axis="y", alpha=0.3)
        for key, label, color in (
            ("omni_trio", "running", PEER_COLORS["omni_trio"]),
            ("waiting", "waiting", "#2ca02c"),
        ):
            values = sorted(samples[key])
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            right.step(values, fractions, where="post", label=label, color=color)
        right.axvline(
            step_ms + TARGET_SLACK_MS,
            color="k",
            linestyle="--",
            linewidth=1,
            label="running target",
        )
        right.axvline(1.0, color="#2ca02c", linestyle=":", linewidth=1, label="waiting target")
        right.set_xscale("log")
        right.set_xlabel("omni_trio abort call, ms")
        right.set_ylabel("fraction of aborts")
        right.legend(fontsize=8)
        right.grid(alpha=0.3)
