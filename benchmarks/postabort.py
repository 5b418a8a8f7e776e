"""``post-abort``: what an aborted request costs the next one (vLLM-Omni's step-abort table).

For each peer and size: the latency of request B alone (baseline); then request A
starts, is aborted after a fixed time (a quarter of one request's raw duration at
that size), and B is submitted as soon as the abort call returns. Columns:

- post-abort: B's latency from its submission to its images;
- total: from A's submission to B's images (A's partial run, the abort, B);
- overhead: post-abort over baseline, in percent: the median over repeats of
  each repeat's ratio to the baseline measured just before it;
- from abort: from the abort call to B's images over baseline, in percent; it
  counts the abort call itself (omni_trio's waits for the release, at most one
  step; the peers' return at once).

The peers abort as they can: naive cancels the caller (its thread runs A to the
end, holding the lock B needs); interrupt also sets ``pipe._interrupt`` (A's loop
spins without model calls, then decodes); omni_trio calls ``handle.abort()``.

Video: the same for a tiny Wan video (the ``substep`` benchmark's deep tiny Wan, 128 px,
17 frames), A aborted half-way through its second step, omni_trio with its cancel points
(L71) vs with them declared off (the step runs to its end): how long, and how many
transformer blocks, the device keeps working on A after the abort call (from hooks on
the blocks, counted when the abort call returns, once A is released), and B's latency.
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from omni_trio import Engine, GenerationRequest, open_engine
from omni_trio.runners import DiffusersRunner

from .common import Options, fmt, md_table, shared_pipeline, spread
from .peers import Call, LockedPipeline, run_raw, sd_request, start_call
from .plot import PEER_COLORS, figure
from .substep import BlockClock, NoCancelPoints, deep_wan, wan_request

__all__ = ["plot_post_abort", "run_post_abort", "table_post_abort"]

PEERS = ("naive", "interrupt", "omni_trio")
#: When A is aborted, as a fraction of one request's raw duration. Picked without
#: measurement: early enough that most of A is left for the naive peer to waste.
ABORT_AT = 0.25
#: The video arms: omni_trio with its cancel points, and with them declared off.
VIDEO_ARMS = ("cancel_points", "step_end")

Sample = dict[str, float]


async def _engine_baseline(engine: Engine, b: GenerationRequest) -> float:
    started = time.perf_counter()
    await engine.generate(b)
    return time.perf_counter() - started


async def _engine_post_abort(
    engine: Engine, a: GenerationRequest, b: GenerationRequest, abort_after: float
) -> Sample:
    started = time.perf_counter()
    async with engine.submit(a) as handle:
        await anyio.sleep(abort_after - (time.perf_counter() - started))
        aborted = time.perf_counter()
        await handle.abort()
    submitted = time.perf_counter()
    await engine.generate(b)
    done = time.perf_counter()
    return {"b_s": done - submitted, "total_s": done - started, "from_abort_s": done - aborted}


async def _peer_baseline(peer: LockedPipeline, b: GenerationRequest) -> float:
    started = time.perf_counter()
    await peer.run(Call(b, observe=False))
    return time.perf_counter() - started


async def _peer_post_abort(
    peer: LockedPipeline, a: GenerationRequest, b: GenerationRequest, abort_after: float
) -> Sample:
    started = time.perf_counter()
    call = Call(a, observe=False)
    async with anyio.create_task_group() as group:
        scope = start_call(group, peer, call)
        await anyio.sleep(abort_after - (time.perf_counter() - started))
        aborted = time.perf_counter()
        peer.abort(call, scope)
    submitted = time.perf_counter()
    await peer.run(Call(b, observe=False))
    done = time.perf_counter()
    await peer.wait_idle()
    return {"b_s": done - submitted, "total_s": done - started, "from_abort_s": done - aborted}


async def _measure_size(size: int, steps: int, repeats: int) -> dict[str, Any]:
    pipe = shared_pipeline("sd")
    a = sd_request(steps, size, seed=1)
    b = sd_request(steps, size, seed=2)
    raw = DiffusersRunner(pipe)
    run_raw(raw, a)  # warm-up
    abort_after = ABORT_AT * run_raw(raw, a).total_s
    peers = {name: LockedPipeline(pipe, interrupt=name == "interrupt") for name in PEERS[:2]}
    baseline: dict[str, list[float]] = {name: [] for name in PEERS}
    post: dict[str, list[Sample]] = {name: [] for name in PEERS}
    async with open_engine(DiffusersRunner(pipe)) as engine:
        await engine.generate(b)  # warm-up
        for peer in peers.values():
            await peer.run(Call(b, observe=False))
        warm = sd_request(2, size, seed=3)
        for _ in range(repeats):  # interleaved: each repeat runs every peer once
            for name, peer in peers.items():
                # An untimed short request first: the baseline, like B after the
                # abort, then runs on threads that just ran this peer's work.
                await peer.run(Call(warm, observe=False))
                baseline[name].append(await _peer_baseline(peer, b))
                post[name].append(await _peer_post_abort(peer, a, b, abort_after))
            await engine.generate(warm)
            baseline["omni_trio"].append(await _engine_baseline(engine, b))
            post["omni_trio"].append(await _engine_post_abort(engine, a, b, abort_after))
    rows = {}
    for name in PEERS:
        base = spread(baseline[name])
        b_s = spread([s["b_s"] for s in post[name]])
        total = spread([s["total_s"] for s in post[name]])
        from_abort = spread([s["from_abort_s"] for s in post[name]])
        # Paired: each repeat's post-abort latency against the baseline measured
        # just before it, so that drift of the machine between repeats cancels.
        pairs = list(zip(post[name], baseline[name], strict=True))
        overhead = spread([(s["b_s"] / b - 1) * 100 for s, b in pairs])
        from_abort_pct = spread([(s["from_abort_s"] / b - 1) * 100 for s, b in pairs])
        rows[name] = {
            "baseline_s": base,
            "post_abort_s": b_s,
            "total_s": total,
            "from_abort_s": from_abort,
            "overhead_pct": overhead["median"],
            "overhead_pct_spread": overhead,
            "from_abort_overhead_pct": from_abort_pct["median"],
        }
    return {"size": size, "abort_after_s": abort_after, "peers": rows}


async def _video_abort(
    engine: Engine, a: GenerationRequest, clock: BlockClock, step_s: float
) -> Sample:
    """Abort ``a`` half-way through its second step; A's device work after the abort call."""
    async with engine.submit(a) as handle:
        async for event in handle:
            if event.step >= 1:
                break
        await anyio.sleep(step_s / 2)
        clock.spans.clear()
        aborted = time.perf_counter()
        await handle.abort()
        returned = time.perf_counter()
    # Released: every block that ended after the abort call was A's.
    ends = [end for _, end in clock.spans if end > aborted]
    return {
        "abort_call_s": returned - aborted,
        "work_after_abort_s": (max(ends) - aborted) if ends else 0.0,
        "blocks_after_abort": float(len(ends)),
    }


async def _step_s(engine: Engine, b: GenerationRequest) -> float:
    """The median time between ``b``'s step events, run alone (a warm-up too)."""
    async with engine.submit(b) as handle:
        times = [time.perf_counter() async for _ in handle]
    return statistics.median(later - earlier for earlier, later in itertools.pairwise(times))


async def _measure_video(
    layers: int, steps: int, repeats: int, size: int, frames: int
) -> dict[str, Any]:
    pipe = deep_wan(layers)
    a = wan_request(1, steps, size=size, frames=frames)
    b = wan_request(2, steps, size=size, frames=frames)
    clock = BlockClock(pipe)
    samples: dict[str, list[Sample]] = {arm: [] for arm in VIDEO_ARMS}
    try:
        async with (
            open_engine(DiffusersRunner(pipe)) as on,
            open_engine(NoCancelPoints(pipe)) as off,
        ):
            engines = {"cancel_points": on, "step_end": off}
            await _step_s(off, b)  # warm-up
            step_s = await _step_s(on, b)
            for _ in range(repeats):  # interleaved: each repeat runs both arms
                for arm, engine in engines.items():
                    baseline = await _engine_baseline(engine, b)
                    sample = await _video_abort(engine, a, clock, step_s)
                    sample["baseline_s"] = baseline
                    sample["b_s"] = await _engine_baseline(engine, b)
                    samples[arm].append(sample)
    finally:
        clock.remove()
    arms = {}
    for arm in VIDEO_ARMS:
        rows = samples[arm]
        arms[arm] = {
            "baseline_s": spread([r["baseline_s"] for r in rows]),
            "post_abort_s": spread([r["b_s"] for r in rows]),
            "abort_call_s": spread([r["abort_call_s"] for r in rows]),
            "work_after_abort_s": spread([r["work_after_abort_s"] for r in rows]),
            "blocks_after_abort": spread([r["blocks_after_abort"] for r in rows]),
            "overhead_pct": spread([(r["b_s"] / r["baseline_s"] - 1) * 100 for r in rows])[
                "median"
            ],
        }
    return {
        "layers": layers,
        "steps": steps,
        "size": size,
        "frames": frames,
        "step_s": step_s,
        "arms": arms,
    }


def run_post_abort(options: Options) -> dict[str, Any]:
    """The post-abort table at 64 and 128 px, every peer at each size."""
    steps, repeats = (10, 1) if options.quick else (20, 11)
    sizes = (64, 128)
    results = [options.run(_measure_size, size, steps, repeats) for size in sizes]
    summary: dict[str, float] = {}
    for name in PEERS:
        key = "interrupt" if name == "interrupt" else name
        values = [r["peers"][name]["overhead_pct"] for r in results]
        # The headline is the worse of the two sizes.
        summary[f"{key}_overhead_pct"] = max(values)
        for r, value in zip(results, values, strict=True):
            summary[f"{key}_overhead_pct_{r['size']}px"] = value
    summary["omni_trio_from_abort_overhead_pct"] = max(
        r["peers"]["omni_trio"]["from_abort_overhead_pct"] for r in results
    )
    # Quick: a shallow model on a small clip, one repeat (seconds matter, not the figure).
    layers, video_repeats, size, frames = (2, 1, 64, 5) if options.quick else (16, 5, 128, 17)
    video = options.run(_measure_video, layers, 3, video_repeats, size, frames)
    for arm in VIDEO_ARMS:
        row = video["arms"][arm]
        summary[f"video_work_after_abort_ms_{arm}"] = row["work_after_abort_s"]["median"] * 1e3
        summary[f"video_blocks_after_abort_{arm}"] = row["blocks_after_abort"]["median"]
        summary[f"video_overhead_pct_{arm}"] = row["overhead_pct"]
    return {
        "config": {
            "model": "tiny sd",
            "sizes": list(sizes),
            "steps": steps,
            "repeats": repeats,
            "abort_at_fraction": ABORT_AT,
            "backend": options.backend,
            "video": {
                "model": f"tiny wan, {layers} blocks (dim 128, ffn 512)",
                "repeats": video_repeats,
                "steps": video["steps"],
            },
        },
        "sizes": results,
        "video": video,
        "summary": summary,
    }


_LABELS = {"naive": "naive", "interrupt": "diffusers-interrupt", "omni_trio": "omni_trio"}


def table_post_abort(result: dict[str, Any]) -> str:
    """configuration | baseline | post-abort | total | overhead % (| from abort %)."""
    rows = []
    config = result["config"]
    for entry in result["sizes"]:
        for name in PEERS:
            r = entry["peers"][name]
            rows.append(
                [
                    f"{_LABELS[name]}, {entry['size']} px",
                    fmt(r["baseline_s"]["median"] * 1e3, 1),
                    fmt(r["post_abort_s"]["median"] * 1e3, 1),
                    fmt(r["total_s"]["median"] * 1e3, 1),
                    f"{r['overhead_pct']:+.1f} %",
                    f"{r['from_abort_overhead_pct']:+.1f} %",
                ]
            )
    head = (
        f"Tiny SD, {config['steps']} steps, A aborted after {config['abort_at_fraction']:.0%} of"
        f" a request's raw duration; medians of {config['repeats']} interleaved repeats (ms);"
        " the overheads are medians of each repeat's ratio to its own baseline.\n\n"
    )
    table = md_table(
        [
            "configuration",
            "baseline (B alone)",
            "post-abort (B)",
            "total (A start to B done)",
            "overhead",
            "from abort call",
        ],
        rows,
    )
    return head + table + _video_table(result)


_VIDEO_LABELS = {
    "cancel_points": "omni_trio, cancel points (L71)",
    "step_end": "omni_trio, cancel points off",
}


def _video_table(result: dict[str, Any]) -> str:
    video = result.get("video")
    if video is None:  # a result from before the video arm
        return ""
    config = result["config"]["video"]
    rows = []
    for arm in VIDEO_ARMS:
        r = video["arms"][arm]
        rows.append(
            [
                _VIDEO_LABELS[arm],
                fmt(r["work_after_abort_s"]["median"] * 1e3, 1),
                fmt(r["work_after_abort_s"]["max"] * 1e3, 1),
                fmt(r["blocks_after_abort"]["median"], 1),
                fmt(r["abort_call_s"]["median"] * 1e3, 1),
                f"{r['overhead_pct']:+.1f} %",
            ]
        )
    head = (
        f"\nVideo: {config['model']}, {video['size']} px, {video['frames']} frames,"
        f" {config['steps']} steps (steps of"
        f" {video['step_s'] * 1e3:.0f} ms); A aborted half-way through its second step; medians"
        f" of {config['repeats']} interleaved repeats. Device work after the abort: from the"
        " abort call to the end of A's last block.\n\n"
    )
    return head + md_table(
        [
            "video",
            "device work after abort, ms",
            "max ms",
            "blocks after abort",
            "abort call, ms",
            "B overhead",
        ],
        rows,
    )


def plot_post_abort(result: dict[str, Any], path: Path) -> None:
    """Baseline and post-abort latency of B per peer, one panel per size."""
    sizes = result["sizes"]
    with figure(path, columns=len(sizes), title="post-abort: latency of B") as axes:
        for ax, entry in zip(axes, sizes, strict=True):
            x = range(len(PEERS))
            base = [entry["peers"][p]["baseline_s"]["median"] * 1e3 for p in PEERS]
            post = [entry["peers"][p]["post_abort_s"]["median"] * 1e3 for p in PEERS]
            ax.bar([i - 0.2 for i in x], base, width=0.4, color="#bbbbbb", label="baseline")
            ax.bar(
                [i + 0.2 for i in x],
                post,
                width=0.4,
                color=[PEER_COLORS[p] for p in PEERS],
                label="post-abort",
            )
            for i, peer in enumerate(PEERS):
                pct = entry["peers"][peer]["overhead_pct"]
                ax.annotate(f"{pct:+.0f}%", (i + 0.2, post[i]), ha="center", va="bottom")
            ax.set_ylim(0, max(post + base) * 1.15)
            ax.set_xticks(list(x), [_LABELS[p] for p in PEERS])
            ax.set_title(f"{entry['size']} px")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
