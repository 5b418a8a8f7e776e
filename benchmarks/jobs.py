"""``jobs``: what checkpoints cost a running video job, and what they save after a crash (L78).

Tiny Wan (32 x 32, 9 frames, one torch thread), one request at a time:

- checkpoint cost: the same request with no checkpoints and with one at every step
  boundary (``every_s=0``, the worst case), in alternating pairs; the worker's part is
  the copy at the boundary (``DiffusersRunner.checkpoint``, timed alone), the rest
  (serializing, in the materializer thread) runs beside the steps. The cost per step
  at the default interval (30 s) is the copy's time over the steps in 30 s;
- restart to resume: a fresh engine on a fresh runner, from ``open_engine`` to the
  first step event of a request resumed from a checkpoint (``resume_from``), beside
  the same request prepared from step 0;
- steps redone after a crash: a run checkpointed every ``INTERVAL_S`` seconds; for
  random crash moments, the steps done then minus the step of the last checkpoint
  the sink had before it, and the work lost in seconds (from that step's end to the
  crash), against the bound: the interval, the step that ends it, and the lag of
  the checkpoint (from its step's event to the sink: its serialization).
"""

from __future__ import annotations

import itertools
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline

from .common import Options, fmt, md_table
from .plot import figure

__all__ = ["plot_jobs", "run_jobs", "table_jobs"]

SIZE = 32
FRAMES = 9
#: The server's default interval (``--checkpoint-every``).
DEFAULT_INTERVAL_S = 30.0
#: The interval of the crash simulation: several steps' worth on tiny Wan.
INTERVAL_S = 0.1


def _request(steps: int, seed: int = 1) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt="a boat", width=SIZE, height=SIZE, num_frames=FRAMES, num_steps=steps, seed=seed
    )


class _Sink:
    """Checkpoints as they arrive (materializer thread), with when they arrived."""

    def __init__(self) -> None:
        self.items: list[tuple[float, ot.Checkpoint]] = []
        self._lock = threading.Lock()

    def __call__(self, checkpoint: ot.Checkpoint) -> None:
        with self._lock:
            self.items.append((time.perf_counter(), checkpoint))


async def _timed_run(
    runner: Any,
    request: ot.GenerationRequest,
    policy: ot.CheckpointPolicy | None,
    resume_from: bytes | None = None,
) -> tuple[float, list[tuple[float, int]], float]:
    """Wall seconds of one request, its step events (when, step), and open-to-first-step."""
    opened = time.perf_counter()
    steps: list[tuple[float, int]] = []
    async with ot.open_engine(runner) as engine:
        started = time.perf_counter()
        async with engine.submit(request, checkpoint=policy, resume_from=resume_from) as handle:
            steps += [(time.perf_counter(), event.step) async for event in handle]
            await handle.result()
        wall = time.perf_counter() - started
    return wall, steps, steps[0][0] - opened


async def _cost(options: Options, pipe: Any, steps: int, pairs: int) -> dict[str, Any]:
    runner = DiffusersRunner(pipe)
    plain: list[float] = []
    every: list[float] = []
    sizes: list[int] = []
    for _ in range(pairs):
        wall, _, _ = await _timed_run(DiffusersRunner(pipe), _request(steps), None)
        plain.append(wall)
        sink = _Sink()
        policy = ot.CheckpointPolicy(every_s=0, sink=sink)
        wall, _, _ = await _timed_run(DiffusersRunner(pipe), _request(steps), policy)
        every.append(wall)
        sizes += [len(c.data) for _, c in sink.items]
    state = runner.prepare(_request(steps), "probe")
    runner.step([state])
    copies = []
    serial = []
    for _ in range(50 if not options.quick else 10):
        started = time.perf_counter()
        copy = runner.checkpoint(state)
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        runner.checkpoint_bytes(copy)
        serial.append(time.perf_counter() - started)
    runner.discard(state)
    runner.close()
    step_s = statistics.median(plain) / steps
    copy_s = statistics.median(copies)
    per_default = copy_s / max(1.0, DEFAULT_INTERVAL_S / step_s)
    return {
        "steps": steps,
        "pairs": pairs,
        "wall_s_plain": plain,
        "wall_s_every_step": every,
        "step_ms": step_s * 1e3,
        "copy_ms": copy_s * 1e3,
        "serialize_ms": statistics.median(serial) * 1e3,
        "checkpoint_bytes": statistics.median(sizes) if sizes else 0,
        "every_step_overhead_pct": 100 * (statistics.median(every) / statistics.median(plain) - 1),
        "default_interval_cost_pct_of_step": 100 * per_default / step_s,
    }


async def _resume(pipe: Any, steps: int, rounds: int) -> dict[str, Any]:
    sink = _Sink()
    await _timed_run(
        DiffusersRunner(pipe), _request(steps), ot.CheckpointPolicy(every_s=0, sink=sink)
    )
    data = sink.items[steps // 2 - 1][1].data
    fresh, resumed = [], []
    for _ in range(rounds):
        fresh.append((await _timed_run(DiffusersRunner(pipe), _request(steps), None))[2])
        resumed.append((await _timed_run(DiffusersRunner(pipe), _request(steps), None, data))[2])
    return {
        "from_step": steps // 2,
        "first_step_ms_fresh": statistics.median(fresh) * 1e3,
        "first_step_ms_resumed": statistics.median(resumed) * 1e3,
    }


async def _redone(pipe: Any, steps: int, crashes: int) -> dict[str, Any]:
    sink = _Sink()
    policy = ot.CheckpointPolicy(every_s=INTERVAL_S, sink=sink)
    _, events, _ = await _timed_run(DiffusersRunner(pipe), _request(steps), policy)
    rng = random.Random(0)
    start, end = events[0][0], events[-1][0]
    durations = [b[0] - a[0] for a, b in itertools.pairwise(events)]
    step_s = statistics.mean(durations)
    stepped = {step: when for when, step in events}
    lags = [when - stepped[c.step] for when, c in sink.items]
    # A quick run can end before its first interval: no checkpoint, no lag to measure.
    measured_lags = lags or [0.0]
    taken = start - durations[0]  # about when its first step began
    redone, lost = [], []
    for _ in range(crashes):
        moment = rng.uniform(start, end)
        done = max(step for when, step in events if when <= moment)
        saved = [c.step for when, c in sink.items if when <= moment]
        last = max(saved) if saved else 0
        redone.append(done - last)
        lost.append(moment - (stepped[last] if last else taken))
    # A checkpoint comes at the first boundary INTERVAL_S after the last one, and reaches
    # the store a lag later: at most the interval, a step and a lag of work is lost.
    bound_s = INTERVAL_S + max(durations) + max(measured_lags)
    return {
        "interval_s": INTERVAL_S,
        "step_ms": step_s * 1e3,
        "step_ms_max": max(durations) * 1e3,
        "lag_ms": statistics.median(measured_lags) * 1e3,
        "lag_ms_max": max(measured_lags) * 1e3,
        "checkpoints": len(sink.items),
        "redone_mean": statistics.mean(redone),
        "redone_max": max(redone),
        "lost_s_max": max(lost),
        "bound_s": bound_s,
        "bound_steps": INTERVAL_S / step_s + 1,
        "redone": redone,
    }


def run_jobs(options: Options) -> dict[str, Any]:
    """Run the three measurements; ``quick``: fewer steps and rounds."""
    torch.set_num_threads(1)
    steps, pairs, rounds, crashes = (6, 1, 1, 50) if options.quick else (40, 5, 5, 500)
    pipe = tiny_pipeline("wan")  # one pipeline: every run builds its own runner on it
    cost = options.run(_cost, options, pipe, steps, pairs)
    resume = options.run(_resume, pipe, steps, rounds)
    redone = options.run(_redone, pipe, steps * 4, crashes)
    return {
        "cost": cost,
        "resume": resume,
        "redone": redone,
        "summary": {
            "default_interval_cost_pct_of_step": cost["default_interval_cost_pct_of_step"],
            "every_step_overhead_pct": cost["every_step_overhead_pct"],
            "restart_to_first_step_ms": resume["first_step_ms_resumed"],
            "redone_max": redone["redone_max"],
            "redone_bound": redone["bound_steps"],
            "lost_s_max": redone["lost_s_max"],
            "lost_bound_s": redone["bound_s"],
        },
    }


def table_jobs(result: dict[str, Any]) -> str:
    """The cost, the resume and the redone steps."""
    cost, resume, redone = result["cost"], result["resume"], result["redone"]
    rows = [
        ["step (tiny Wan, 32x32, 9 frames)", f"{fmt(cost['step_ms'])} ms"],
        ["checkpoint copy at a boundary (worker)", f"{fmt(cost['copy_ms'], 3)} ms"],
        ["serialize (materializer)", f"{fmt(cost['serialize_ms'], 3)} ms"],
        ["checkpoint size", f"{fmt(cost['checkpoint_bytes'], 0)} bytes"],
        [
            "cost per step at 30 s (target <= 2 %)",
            f"{cost['default_interval_cost_pct_of_step']:.5f} %",
        ],
        ["overhead at every step (worst case)", f"{cost['every_step_overhead_pct']:+.1f} %"],
        ["open to first step, fresh", f"{fmt(resume['first_step_ms_fresh'])} ms"],
        [
            f"open to first step, resumed at step {resume['from_step']}",
            f"{fmt(resume['first_step_ms_resumed'])} ms",
        ],
        [
            f"steps redone after a crash, every {redone['interval_s']} s (mean / max)",
            f"{redone['redone_mean']:.2f} / {redone['redone_max']}",
        ],
        ["steps in one interval at the mean step, + 1", f"{redone['bound_steps']:.1f}"],
        [
            "work lost, max (bound: interval + longest step + longest lag)",
            f"{fmt(redone['lost_s_max'] * 1e3)} ms ({fmt(redone['bound_s'] * 1e3)} ms;"
            f" step max {fmt(redone['step_ms_max'])} ms, lag max {fmt(redone['lag_ms_max'])} ms)",
        ],
    ]
    return md_table(["what", "figure"], rows)


def plot_jobs(result: dict[str, Any], path: Path) -> None:
    """Wall time without and with a checkpoint at every step; redone steps per crash."""
    cost, redone = result["cost"], result["redone"]
    with figure(path, columns=2, title="jobs: checkpoints (tiny Wan)") as (left, right):
        left.boxplot([cost["wall_s_plain"], cost["wall_s_every_step"]])
        left.set_xticks([1, 2], ["no checkpoints", "every step"])
        left.set_ylabel(f"seconds per request ({cost['steps']} steps)")
        left.grid(axis="y", alpha=0.3)
        right.hist(redone["redone"], bins=range(max(redone["redone"]) + 2))
        right.axvline(
            redone["bound_steps"], color="#d62728", label="one interval at the mean step, + 1"
        )
        right.set_xlabel(f"steps redone (checkpoint every {redone['interval_s']} s)")
        right.set_ylabel("crashes")
        right.legend(fontsize=8)
