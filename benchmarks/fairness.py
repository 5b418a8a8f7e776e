"""``fairness``: a heavy tenant flooding beside a light one, fair share vs FIFO (L57).

Two parts.

The policy, on a virtual clock: the engine's own queue, fair share and boundary
policy (``WaitingQueue``, ``FairShare``, ``plan_boundary`` with the engine's default
rules, preemption included: the code the workers run at each step boundary) drive a
simulated worker with batches of 4 that join at step boundaries,
each batch step taking ``STEP_S`` of virtual time, whatever its size. No thread,
no sleep: the figures depend on the arrivals alone (seeded), not on the machine.

- Flood: "heavy" sends 10 times the requests of "light", both Poisson, together 2x
  the worker's capacity; the light tenant's latency (admission to its last step)
  with fair share (a light newcomer takes the place of a heavy member of a full
  batch, L61 amended; beside the engine's window of ``RECENT_STEPS`` full steps,
  shorter ones, ``WINDOWS``), with fair share in the queue only (``tenant_preemption``
  off: it waits for a place to free), with FIFO (every request the default
  tenant: the order of admission), and alone on an idle engine (its arrivals
  only). Target: fair share's
  p99 within 1.5x of alone's; FIFO's grows with the run (the queue grows without
  bound at 2x).
- Shares: both tenants backlogged (each alone 2x the capacity), the light one's
  requests 3 times the steps of the heavy one's; weights 1:1 and 3:1; each tenant's
  share of the device step-seconds (a batch step's seconds split over its members)
  while both wait. Target: within 5 % of its weight's share.

The cost of admission on a real engine (a ``GatedRunner`` holds the worker, so all
wait): ``engine.submit`` per request with 10,000 waiting, over 100 tenants and with
none; and the cost per request taken by the policy (``take``) from those 10,000.
Target: flat (100 tenants within 1.5x of none).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_trio import EngineConfig, GenerationRequest, RequestHandle, open_engine
from omni_trio._fairshare import FairShare
from omni_trio._queue import WaitingQueue, take
from omni_trio._scheduler import RECENT_STEPS, BoundaryRules, Member, RecentSteps, plan_boundary
from omni_trio.testing import GatedRunner, assume_step_cost

from .common import Options, fmt, md_table
from .plot import figure

__all__ = ["plot_fairness", "run_fairness", "table_fairness"]

#: The simulated worker: batches of this many, this long a step, this many steps.
BATCH = 4
STEP_S = 0.1
STEPS = 10
#: Requests per second the worker completes (all batches full).
CAPACITY = BATCH / (STEPS * STEP_S)
#: How much the heavy tenant sends per request of the light one, and the overload.
HEAVY_OVER_LIGHT = 10
OVERLOAD = 2.0
#: The light tenant's requests in the shares runs: this many times the steps.
LIGHT_STEPS = 3 * STEPS
#: Shorter windows of tenant preemption than ``RECENT_STEPS``, measured beside it.
WINDOWS = (64, 256)


@dataclass(frozen=True, slots=True)
class _Arrival:
    at: float
    tenant: str
    steps: int


def _poisson(
    rate: float, until: float, tenant: str, steps: int, rng: random.Random
) -> list[_Arrival]:
    arrivals: list[_Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= until:
            return arrivals
        arrivals.append(_Arrival(at, tenant, steps))


def _simulate(
    arrivals: list[_Arrival],
    *,
    fair: bool,
    weights: dict[str, float] | None = None,
    tenant_preemption: bool | None = None,
    window: int | None = None,
) -> dict[str, Any]:
    """Run the policy over ``arrivals`` on a virtual clock; each tenant's latencies and
    device step-seconds (those while both tenants waited, too), and the suspensions.

    Each boundary is the worker's: ``plan_boundary`` with the engine's default rules
    (preemption on, ``max_preemptions``, ``tenant_preemption``) decides what joins and
    whom a newcomer suspends; a suspended request goes to the parked queue (one fair
    share with the fresh one, as in the engine) with the steps it has left.
    ``tenant_preemption``: ``None`` for the engine's default.
    """
    arrivals = sorted(arrivals, key=lambda a: a.at)
    defaults = EngineConfig()
    rules = BoundaryRules(
        max_batch=BATCH,
        can_join=True,
        preempting=defaults.preemption,
        max_preemptions=defaults.max_preemptions,
        tenant_preemption=(
            defaults.tenant_preemption if tenant_preemption is None else tenant_preemption
        ),
        weights=weights or {},
    )
    share = FairShare(weights or {})
    fresh: WaitingQueue[int] = WaitingQueue(share)
    parked: WaitingQueue[int] = WaitingQueue(share)
    running: list[int] = []
    left: dict[int, int] = {}  # steps left per admitted arrival
    sequence: dict[int, int] = {}
    preempted: dict[int, int] = {}
    latencies: dict[str, list[float]] = {}
    device: dict[str, float] = {}
    contested: dict[str, float] = {}
    waiting: dict[str, int] = {}
    now, next_arrival, suspensions = 0.0, 0, 0
    recent = RecentSteps(BATCH, RECENT_STEPS if window is None else window)

    def tenant_of(index: int) -> str | None:
        return arrivals[index].tenant if fair else None

    while next_arrival < len(arrivals) or len(fresh) or len(parked) or running:
        while next_arrival < len(arrivals) and arrivals[next_arrival].at <= now:
            arrival = arrivals[next_arrival]
            sequence[next_arrival] = fresh.push(
                next_arrival,
                0,
                steps=arrival.steps,
                tenant=tenant_of(next_arrival),
                cost=arrival.steps * STEP_S,
            )
            left[next_arrival], preempted[next_arrival] = arrival.steps, 0
            waiting[arrival.tenant] = waiting.get(arrival.tenant, 0) + 1
            next_arrival += 1
        members = [
            Member(
                item=index,
                key=0,
                rank=(0, math.inf, sequence[index]),
                preemptions=preempted[index],
                stopped=False,
                tenant=tenant_of(index),
            )
            for index in running
        ]
        plan = plan_boundary(
            members,
            fresh=fresh,
            parked=parked,
            rules=rules,
            stopping=False,
            idle=0,
            recent=recent.view(),
        )
        starting = list(plan.admit)
        if plan.preempt is not None:
            newcomer = plan.preempt.newcomer
            if not fresh.claim(newcomer):
                parked.claim(newcomer)
            starting = [newcomer]
            for victim in plan.preempt.victims:
                running.remove(victim)
                preempted[victim] += 1
                suspensions += 1
                waiting[arrivals[victim].tenant] += 1
                parked.push(
                    victim,
                    0,
                    steps=left[victim],
                    sequence=sequence[victim],
                    tenant=tenant_of(victim),
                )
        for index in starting:
            waiting[arrivals[index].tenant] -= 1
            running.append(index)
        if not running:
            now = arrivals[next_arrival].at
            continue
        both = sum(1 for count in waiting.values() if count) >= 2
        now += STEP_S
        recent.ran([(0, tenant_of(index)) for index in running])
        for index in running:
            tenant = arrivals[index].tenant
            device[tenant] = device.get(tenant, 0.0) + STEP_S / len(running)
            if both:
                contested[tenant] = contested.get(tenant, 0.0) + STEP_S / len(running)
            left[index] -= 1
            if not left[index]:
                latencies.setdefault(tenant, []).append(now - arrivals[index].at)
        running = [index for index in running if left[index]]
    return {
        "latencies": latencies,
        "device_s": device,
        "contested_s": contested,
        "suspensions": suspensions,
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _flood(duration: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    total = OVERLOAD * CAPACITY
    light_rate = total / (HEAVY_OVER_LIGHT + 1)
    light = _poisson(light_rate, duration, "light", STEPS, rng)
    heavy = _poisson(total - light_rate, duration, "heavy", STEPS, rng)
    runs = {
        "fair": _simulate(heavy + light, fair=True),
        "fair_queue_only": _simulate(heavy + light, fair=True, tenant_preemption=False),
        "fifo": _simulate(heavy + light, fair=False),
        "alone": _simulate(light, fair=True),
    }
    # RECENT_STEPS's choice: shorter windows of tenant preemption.
    for window in WINDOWS:
        runs[f"fair_window_{window}"] = _simulate(heavy + light, fair=True, window=window)
    result: dict[str, Any] = {"requests": {"light": len(light), "heavy": len(heavy)}}
    for name, run in runs.items():
        values = run["latencies"]["light"]
        half = len(values) // 2
        result[name] = {
            "light_p50_s": statistics.median(values),
            "light_p99_s": _p99(values),
            "light_p99_first_half_s": _p99(values[:half]),
            "light_p99_second_half_s": _p99(values[half:]),
            "suspensions": run["suspensions"],
        }
    return result


def _shares(duration: float, seed: int, weights: dict[str, float]) -> dict[str, Any]:
    rng = random.Random(seed)
    heavy_rate = OVERLOAD * CAPACITY
    heavy = _poisson(heavy_rate, duration, "heavy", STEPS, rng)
    light = _poisson(heavy_rate * STEPS / LIGHT_STEPS, duration, "light", LIGHT_STEPS, rng)
    run = _simulate(heavy + light, fair=True, weights=weights)
    contested = run["contested_s"]
    total = sum(contested.values())
    weight = {tenant: weights.get(tenant, 1.0) for tenant in ("heavy", "light")}
    result: dict[str, Any] = {"weights": weight, "contested_s": total}
    for tenant in ("heavy", "light"):
        share = contested.get(tenant, 0.0) / total
        target = weight[tenant] / sum(weight.values())
        requests = len(run["latencies"].get(tenant, []))
        result[tenant] = {"share": share, "target": target, "requests_done": requests}
    result["max_error"] = max(
        abs(result[t]["share"] - result[t]["target"]) / result[t]["target"]
        for t in ("heavy", "light")
    )
    return result


async def _admission(waiting: int, tenants: int) -> float:
    """Seconds per ``engine.submit`` with ``waiting`` requests of ``tenants`` tenants."""
    runner = GatedRunner(gate_timeout=600.0)
    config = EngineConfig(max_batch_size=1, max_waiting=waiting + 1, preemption=False)
    base = GenerationRequest(prompt="fair", num_steps=2, height=16, width=16, seed=0)
    requests = [
        base
        if not tenants
        else GenerationRequest(
            prompt="fair", num_steps=2, height=16, width=16, seed=0, tenant=f"t{i % tenants}"
        )
        for i in range(waiting)
    ]
    async with open_engine(runner, config) as engine:
        assume_step_cost(engine, 1e-9)
        held = engine.submit(base, request_id="held")
        await runner.wait_arrived(1)
        started = time.perf_counter()
        handles: list[RequestHandle] = [engine.submit(request) for request in requests]
        elapsed = time.perf_counter() - started
        for handle in handles:
            await engine.abort(handle.request_id)
            await handle.aclose()
        runner.open_gate()
        await held.result()
        await held.aclose()
    return elapsed / waiting


def _take_cost(waiting: int, tenants: int) -> float:
    """Seconds per request taken by the policy from ``waiting`` over ``tenants`` tenants."""
    queue: WaitingQueue[int] = WaitingQueue(FairShare())
    rng = random.Random(0)
    for index in range(waiting):
        tenant = f"t{index % tenants}" if tenants else None
        queue.push(index, 0, tenant=tenant, cost=rng.choice((1.0, 2.0, 4.0)))
    started = time.perf_counter()
    while len(queue):
        take((queue,), batch_key=None, free=1, can_join=True)
    return (time.perf_counter() - started) / waiting


def run_fairness(options: Options) -> dict[str, Any]:
    """Measure the flood, the shares and the admission cost (see the module)."""
    duration = 120.0 if options.quick else 1200.0
    waiting = 1_000 if options.quick else 10_000
    repeats = 1 if options.quick else 3
    flood = _flood(duration, seed=1)
    shares = {
        "1:1": _shares(duration, 2, {}),
        "3:1": _shares(duration, 3, {"heavy": 3.0}),
    }
    admit = {
        label: min(options.run(_admission, waiting, tenants) for _ in range(repeats))
        for label, tenants in (("none", 0), ("100", 100))
    }
    takes = {
        label: min(_take_cost(waiting, tenants) for _ in range(repeats))
        for label, tenants in (("none", 0), ("100", 100))
    }
    fair, fifo, alone = flood["fair"], flood["fifo"], flood["alone"]
    summary = {
        "light_p99_over_idle_fair": fair["light_p99_s"] / alone["light_p99_s"],
        "light_p99_over_idle_fifo": fifo["light_p99_s"] / alone["light_p99_s"],
        "light_p99_over_idle_fair_queue_only": (
            flood["fair_queue_only"]["light_p99_s"] / alone["light_p99_s"]
        ),
        "share_error_1to1": shares["1:1"]["max_error"],
        "share_error_3to1": shares["3:1"]["max_error"],
        "admit_us_100_tenants": admit["100"] * 1e6,
        "admit_us_no_tenant": admit["none"] * 1e6,
        "admit_ratio": admit["100"] / admit["none"],
        "take_us_100_tenants": takes["100"] * 1e6,
        "take_us_no_tenant": takes["none"] * 1e6,
        "take_ratio": takes["100"] / takes["none"],
    }
    return {
        "config": {
            "batch": BATCH,
            "step_s": STEP_S,
            "steps": STEPS,
            "light_steps_in_shares": LIGHT_STEPS,
            "overload": OVERLOAD,
            "heavy_over_light": HEAVY_OVER_LIGHT,
            "duration_s": duration,
            "waiting": waiting,
        },
        "flood": flood,
        "shares": shares,
        "admit_s": admit,
        "take_s": takes,
        "summary": summary,
    }


def table_fairness(result: dict[str, Any]) -> str:
    """The light tenant's latency per mode; the shares per weighting; the costs."""
    config, flood = result["config"], result["flood"]
    head = (
        f"The policy on a virtual clock: batches of {config['batch']} joining at step"
        f" boundaries, {config['steps']} steps of {config['step_s']} s each;"
        f" {config['duration_s']:g} s of Poisson arrivals at {config['overload']:g}x capacity,"
        f" the heavy tenant {config['heavy_over_light']}x the light one's rate"
        f" ({flood['requests']['heavy']} and {flood['requests']['light']} requests)."
        " Latency: admission to the last step.\n\n"
    )
    rows = [
        [
            mode,
            fmt(flood[mode]["light_p50_s"]),
            fmt(flood[mode]["light_p99_s"]),
            fmt(flood[mode]["light_p99_first_half_s"]),
            fmt(flood[mode]["light_p99_second_half_s"]),
            fmt(flood[mode]["light_p99_s"] / flood["alone"]["light_p99_s"]),
            str(flood[mode]["suspensions"]),
        ]
        for mode in (
            "alone",
            "fair",
            *(f"fair_window_{w}" for w in WINDOWS),
            "fair_queue_only",
            "fifo",
        )
    ]
    latency = md_table(
        [
            "light tenant",
            "p50 s",
            "p99 s",
            "p99 first half s",
            "p99 second half s",
            "p99 / alone",
            "suspensions",
        ],
        rows,
    )
    share_rows = [
        [
            label,
            tenant,
            fmt(run["weights"][tenant], 0),
            f"{100 * run[tenant]['share']:.1f} %",
            f"{100 * run[tenant]['target']:.1f} %",
            str(run[tenant]["requests_done"]),
        ]
        for label, run in result["shares"].items()
        for tenant in ("heavy", "light")
    ]
    shares = md_table(
        ["weights", "tenant", "weight", "share of step-seconds", "weight's share", "requests done"],
        share_rows,
    )
    costs = md_table(
        ["tenants", "submit µs/request", "take µs/request"],
        [
            [label, fmt(result["admit_s"][key] * 1e6, 1), fmt(result["take_s"][key] * 1e6, 1)]
            for label, key in (("none", "none"), ("100", "100"))
        ],
    )
    return (
        head + latency + f"\n\nBoth tenants backlogged (each 2x capacity), the light one's requests"
        f" {config['light_steps_in_shares']} steps: shares of the device step-seconds while"
        " both waited.\n\n"
        + shares
        + f"\n\n{config['waiting']:,} requests waiting (a held GatedRunner for submit; the"
        " policy alone for take), over 100 tenants and none.\n\n" + costs + "\n"
    )


def plot_fairness(result: dict[str, Any], path: Path) -> None:
    """The light tenant's p99 latency per mode; the shares against the weights."""
    with figure(path, columns=2, title="fairness: a heavy tenant flooding beside a light one") as (
        left,
        right,
    ):
        modes = ["alone", "fair", "fair_queue_only", "fifo"]
        left.bar(
            modes,
            [result["flood"][m]["light_p99_s"] for m in modes],
            color=["tab:gray", "tab:blue", "tab:cyan", "tab:red"],
        )
        left.axhline(
            1.5 * result["flood"]["alone"]["light_p99_s"],
            color="k",
            linestyle="--",
            linewidth=1,
            label="1.5x alone",
        )
        left.set_yscale("log")
        left.set_ylabel("light tenant's p99 latency, s")
        left.legend(fontsize=8)
        labels, shares, targets = [], [], []
        for label, run in result["shares"].items():
            for tenant in ("heavy", "light"):
                labels.append(f"{label} {tenant}")
                shares.append(100 * run[tenant]["share"])
                targets.append(100 * run[tenant]["target"])
        right.bar(labels, shares, color="tab:blue", label="measured")
        right.scatter(labels, targets, color="k", zorder=3, label="weight's share")
        right.set_ylabel("% of step-seconds while both wait")
        right.legend(fontsize=8)
        for ax in (left, right):
            ax.grid(axis="y", alpha=0.3)
