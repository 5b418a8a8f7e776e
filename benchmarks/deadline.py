"""``deadline``: goodput under a 2x overload, with deadlines (L62) and with FIFO.

A ``FakeRunner`` whose steps sleep (so the figures are about scheduling, not a
model) serves a small batch. Open-loop arrivals come at twice the engine's
capacity (``max_batch_size`` requests per solo latency, the solo latency measured
first), on a schedule of exponential gaps drawn from a seeded generator: the same
schedule, in the same seconds, for both peers of a repeat. Every request has the
same size and steps and the same deadline, a few solo latencies.

- deadline: the requests carry ``deadline_s``; the engine refuses what its estimate
  says cannot be met (``DeadlineError``) and aborts what still runs late, at its
  next step boundary (reason ``"deadline"``).
- fifo: the same engine and load, the requests carry no deadline; each is judged
  against the deadline it would have had, and every one runs to its end.

A request is *good* when its result came back before its deadline, measured from
its submission. Goodput is good requests per second of the schedule (from the
first arrival to the last: both peers face the same load over the same span, so
the ratio of goodputs is the ratio of good requests). A request is *missed* when
it is not good: refused, aborted, or late; ``steps_wasted_per_missed`` is the
member-steps the runner ran for missed requests (``RequestMetrics.steps_done``),
divided by their number. The run checks that the steps it counts per request add
up to the runner's own count.

A refusal is *wrong* when the request would have met its deadline. The benchmark
cannot run a refused request to find out, but it knows one case for sure: a
request refused while nothing waited and a worker had a free place in its batch
(every request here has one batch key) would have started at the next boundary
and run its steps in about one solo latency, well within its deadline of
``DEADLINE_FACTOR`` solo latencies. ``refused_startable`` counts those: a lower
bound on the wrong refusals.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from omni_trio import (
    DeadlineError,
    Engine,
    EngineConfig,
    GenerationRequest,
    RequestAbortedError,
    RequestHandle,
    open_engine,
)
from omni_trio.testing import FakeRunner

from .common import Options, fmt, md_table, spread
from .plot import figure

__all__ = ["plot_deadline", "run_deadline", "table_deadline"]

#: Seconds each batch step sleeps: long beside the engine's per-step cost (tens of
#: µs), short enough that a full run takes a minute.
STEP_S = 0.01
STEPS = 8
MAX_BATCH = 2
SIZE = 16
#: The load, in multiples of the engine's capacity.
OVERLOAD = 2.0
#: Every request's deadline, in solo latencies (picked without measurement: room
#: for a wait of a few batches, far less than FIFO's growing queue).
DEADLINE_FACTOR = 4.0
#: Solo requests timed before the run; the median is the solo latency.
SOLO_RUNS = 5
PEERS = ("deadline", "fifo")
KINDS = ("good", "late", "aborted", "refused")


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How one request of the schedule ended, and the member-steps it cost."""

    kind: str  # one of KINDS
    steps: int
    latency_s: float | None  # from submission to its result or abort; None if refused
    #: Refused while the engine would have started it at the next boundary.
    startable: bool = False


def schedule(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival offsets (seconds from the first): exponential gaps at ``rate``/s."""
    rng = random.Random(seed)
    offsets = [0.0]
    for _ in range(count - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
    return offsets


def _request(index: int, deadline_s: float | None) -> GenerationRequest:
    return GenerationRequest(
        prompt="a flower",
        num_steps=STEPS,
        height=SIZE,
        width=SIZE,
        seed=index % 4,
        deadline_s=deadline_s,
    )


def _engine_parts(count: int) -> tuple[FakeRunner, EngineConfig]:
    runner = FakeRunner(step_seconds=STEP_S, max_batch_size=MAX_BATCH)
    # Room for FIFO's whole backlog: no QueueFullError muddles its figures.
    return runner, EngineConfig(max_batch_size=MAX_BATCH, max_waiting=count + 1)


async def _solo_latency() -> float:
    runner, config = _engine_parts(1)
    async with open_engine(runner, config) as engine:
        await engine.generate(_request(0, None))  # warm-up
        times = []
        for index in range(SOLO_RUNS):
            started = time.perf_counter()
            await engine.generate(_request(index, None))
            times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _consume(
    handle: RequestHandle, submitted: float, deadline_s: float, out: list[Outcome]
) -> None:
    async with handle:
        try:
            output = await handle.result()
        except RequestAbortedError as exc:
            if exc.reason != "deadline":
                raise
            metrics = handle.metrics
            assert metrics is not None
            latency = time.perf_counter() - submitted
            out.append(Outcome(kind="aborted", steps=metrics.steps_done, latency_s=latency))
            return
    latency = time.perf_counter() - submitted
    kind = "good" if latency <= deadline_s else "late"
    out.append(Outcome(kind=kind, steps=output.metrics.steps_done, latency_s=latency))


def _startable(engine: Engine) -> bool:
    """Whether a new request would start at the next boundary: none waits, a batch has room."""
    stats = engine.statistics()
    return stats.waiting == 0 and any(worker.running < MAX_BATCH for worker in stats.workers)


async def _offer(
    engine: Engine,
    group: anyio.abc.TaskGroup,
    arrivals: list[float],
    deadline_s: float,
    *,
    carry_deadline: bool,
    out: list[Outcome],
) -> None:
    """Submit on the schedule (open loop: never waiting for an outcome)."""
    start = anyio.current_time()
    for index, at in enumerate(arrivals):
        await anyio.sleep_until(start + at)
        submitted = time.perf_counter()
        try:
            handle = engine.submit(_request(index, deadline_s if carry_deadline else None))
        except DeadlineError:
            out.append(
                Outcome(kind="refused", steps=0, latency_s=None, startable=_startable(engine))
            )
            continue
        group.start_soon(_consume, handle, submitted, deadline_s, out)


async def _run_peer(peer: str, arrivals: list[float], deadline_s: float) -> dict[str, Any]:
    runner, config = _engine_parts(len(arrivals))
    out: list[Outcome] = []
    async with open_engine(runner, config) as engine:
        # Warm-up: the first step is measured, so admission can estimate (L62).
        await engine.generate(_request(0, None))
        steps_before = runner.steps_run
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            await _offer(
                engine, group, arrivals, deadline_s, carry_deadline=peer == "deadline", out=out
            )
        drained_s = time.perf_counter() - started
        steps = runner.steps_run - steps_before
    assert len(out) == len(arrivals)
    counted = sum(o.steps for o in out)
    assert counted == steps, f"{peer}: per-request steps {counted} != runner's {steps}"
    return _peer_figures(out, window_s=arrivals[-1], drained_s=drained_s)


def _peer_figures(out: list[Outcome], *, window_s: float, drained_s: float) -> dict[str, Any]:
    counts = {kind: sum(o.kind == kind for o in out) for kind in KINDS}
    missed = [o for o in out if o.kind != "good"]
    aborted = [o for o in out if o.kind == "aborted"]
    running_aborts = [o for o in aborted if o.steps > 0]
    good_latency = [o.latency_s for o in out if o.kind == "good" and o.latency_s is not None]
    steps_missed = sum(o.steps for o in missed)
    steps_all = sum(o.steps for o in out)
    return {
        "requests": len(out),
        "counts": counts,
        "refused_startable": sum(o.startable for o in out),
        "goodput_rps": counts["good"] / window_s,
        "window_s": window_s,
        "drained_s": drained_s,
        "steps_run": steps_all,
        "steps_missed": steps_missed,
        "steps_wasted_per_missed": steps_missed / len(missed) if missed else 0.0,
        "useful_step_share": (steps_all - steps_missed) / steps_all if steps_all else 0.0,
        "running_aborts": len(running_aborts),
        "steps_per_running_abort": (
            sum(o.steps for o in running_aborts) / len(running_aborts) if running_aborts else 0.0
        ),
        "good_latency_s": spread(good_latency) if good_latency else None,
    }


async def _measure(count: int, repeats: int) -> dict[str, Any]:
    solo_s = await _solo_latency()
    rate = OVERLOAD * MAX_BATCH / solo_s
    deadline_s = DEADLINE_FACTOR * solo_s
    runs = []
    for seed in range(repeats):
        arrivals = schedule(count, rate, seed)
        # Interleaved: each repeat runs both peers on the same schedule.
        runs.append(
            {
                "seed": seed,
                "peers": {peer: await _run_peer(peer, arrivals, deadline_s) for peer in PEERS},
            }
        )
    return {"solo_s": solo_s, "rate_rps": rate, "deadline_s": deadline_s, "runs": runs}


def _pooled(runs: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """One peer's figures over every repeat: counts summed, goodput as medians."""
    figures = [run["peers"][peer] for run in runs]
    counts = {kind: sum(f["counts"][kind] for f in figures) for kind in KINDS}
    missed = sum(counts[kind] for kind in KINDS if kind != "good")
    steps_missed = sum(f["steps_missed"] for f in figures)
    steps_run = sum(f["steps_run"] for f in figures)
    running_aborts = sum(f["running_aborts"] for f in figures)
    return {
        "counts": counts,
        "refused_startable": sum(f["refused_startable"] for f in figures),
        "goodput_rps": spread([f["goodput_rps"] for f in figures]),
        "steps_wasted_per_missed": steps_missed / missed if missed else 0.0,
        "useful_step_share": (steps_run - steps_missed) / steps_run if steps_run else 0.0,
        "running_aborts": running_aborts,
        "steps_per_running_abort": (
            sum(f["steps_per_running_abort"] * f["running_aborts"] for f in figures)
            / running_aborts
            if running_aborts
            else 0.0
        ),
        "drained_s": spread([f["drained_s"] for f in figures]),
    }


def run_deadline(options: Options) -> dict[str, Any]:
    """Both peers on the same seeded 2x overload, ``repeats`` schedules."""
    count, repeats = (40, 1) if options.quick else (300, 3)
    data = options.run(_measure, count, repeats)
    runs = data["runs"]
    peers = {peer: _pooled(runs, peer) for peer in PEERS}
    # Paired: each schedule's ratio, then the median over schedules.
    ratios = [
        run["peers"]["deadline"]["goodput_rps"] / max(run["peers"]["fifo"]["goodput_rps"], 1e-9)
        for run in runs
    ]
    with_deadlines, fifo = peers["deadline"], peers["fifo"]
    return {
        "config": {
            "runner": "FakeRunner, sleeping steps",
            "step_ms": STEP_S * 1e3,
            "steps": STEPS,
            "max_batch_size": MAX_BATCH,
            "size": SIZE,
            "overload": OVERLOAD,
            "deadline_factor": DEADLINE_FACTOR,
            "requests_per_repeat": count,
            "repeats": repeats,
            "backend": options.backend,
        },
        "solo_ms": data["solo_s"] * 1e3,
        "rate_rps": data["rate_rps"],
        "deadline_ms": data["deadline_s"] * 1e3,
        "runs": runs,
        "peers": peers,
        "summary": {
            "goodput_ratio_over_fifo": statistics.median(ratios),
            "steps_wasted_per_missed": with_deadlines["steps_wasted_per_missed"],
            "fifo_steps_wasted_per_missed": fifo["steps_wasted_per_missed"],
            "goodput_rps": with_deadlines["goodput_rps"]["median"],
            "fifo_goodput_rps": fifo["goodput_rps"]["median"],
            "refused": with_deadlines["counts"]["refused"],
            "refused_startable": with_deadlines["refused_startable"],
            "deadline_aborts": with_deadlines["counts"]["aborted"],
            "steps_per_running_abort": with_deadlines["steps_per_running_abort"],
            "useful_step_share": with_deadlines["useful_step_share"],
            "fifo_useful_step_share": fifo["useful_step_share"],
        },
    }


def table_deadline(result: dict[str, Any]) -> str:
    """Per peer: goodput, outcomes, steps wasted on missed requests."""
    config = result["config"]
    rows = []
    for peer in PEERS:
        p = result["peers"][peer]
        c = p["counts"]
        g = p["goodput_rps"]
        rows.append(
            [
                peer,
                f"{fmt(g['median'], 1)} ({fmt(g['min'], 1)}-{fmt(g['max'], 1)})",
                f"{c['good']}",
                f"{c['late']}",
                f"{c['aborted']} ({p['running_aborts']} running)",
                # Runs before refusals of startable requests were counted lack the field.
                f"{c['refused']}"
                + (f" ({p['refused_startable']} startable)" if "refused_startable" in p else ""),
                fmt(p["steps_wasted_per_missed"]),
                f"{p['useful_step_share']:.0%}",
            ]
        )
    total = config["requests_per_repeat"] * config["repeats"]
    head = (
        f"{config['repeats']} seeded schedules of {config['requests_per_repeat']} requests"
        f" ({total} in all), open loop at {config['overload']:g}x the capacity"
        f" ({result['rate_rps']:.1f} requests/s: max_batch_size {config['max_batch_size']} per"
        f" solo latency of {result['solo_ms']:.1f} ms; {config['steps']} steps of"
        f" {config['step_ms']:g} ms, FakeRunner), deadline {result['deadline_ms']:.0f} ms"
        f" ({config['deadline_factor']:g} solo latencies). Goodput: requests done before their"
        " deadline per second of the schedule (median over schedules, min-max); counts summed"
        " over schedules; steps wasted: member-steps run on requests that missed their"
        " deadline, per missed request (refused ones count, at 0 steps); the useful share is"
        " the share of all member-steps that went to good requests; refused *startable*:"
        " refused while nothing waited and a batch had room, so it would have started at the"
        " next boundary and met its deadline (a lower bound on wrong refusals). Running"
        " aborts ran"
        f" {result['summary']['steps_per_running_abort']:.2f} steps each on average.\n\n"
    )
    return head + md_table(
        [
            "peer",
            "goodput req/s",
            "good",
            "late",
            "deadline aborts",
            "refused",
            "steps wasted / missed",
            "useful steps",
        ],
        rows,
    )


_COLORS = {"deadline": "#1f77b4", "fifo": "#7f7f7f"}
_KIND_COLORS = {"good": "#2ca02c", "late": "#d62728", "aborted": "#ff7f0e", "refused": "#bbbbbb"}


def plot_deadline(result: dict[str, Any], path: Path) -> None:
    """Goodput per peer; each peer's outcomes, stacked."""
    with figure(path, columns=2, title="deadline: a 2x overload") as (left, right):
        x = range(len(PEERS))
        goodput = [result["peers"][p]["goodput_rps"]["median"] for p in PEERS]
        left.bar(list(x), goodput, color=[_COLORS[p] for p in PEERS])
        left.set_xticks(list(x), list(PEERS))
        left.set_ylabel("goodput, requests/s")
        left.grid(axis="y", alpha=0.3)
        bottom = [0] * len(PEERS)
        for kind in KINDS:
            counts = [result["peers"][p]["counts"][kind] for p in PEERS]
            right.bar(list(x), counts, bottom=bottom, color=_KIND_COLORS[kind], label=kind)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        right.set_xticks(list(x), list(PEERS))
        right.set_ylabel("requests")
        right.legend(fontsize=8)
        right.grid(axis="y", alpha=0.3)
