"""``substep``: an abort inside a long step, with cancel points (L71) vs at the step's end.

A tiny Wan transformer made deep (its layer count picked so that one step takes
about a second on this CPU, one torch thread; 128 x 128 px, 17 frames): a request
runs, and after its first step event the test waits a uniform random fraction of
a step, then times ``await engine.abort(id)``, which returns once the worker
released the request. Two engines on the same pipeline, trials interleaved: one
with the runner's cancel points (the step is left at the next transformer block),
one with them declared off (the step runs to its end, as L7 alone promises). The
block time is each block's forward, timed by hooks on a direct step.

Hook cost: tiny SD at 64 px, the runner's ``step`` called directly, per step, with
the cancel-point hooks on the UNet's blocks armed as in the engine (a no-op check)
vs the hooks removed; repeats alternate the two, and the figure is the median of
the repeats' ratios.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from omni_trio import EngineConfig, GenerationRequest, open_engine
from omni_trio._cancelpoint import armed
from omni_trio.runners import DiffusersRunner, RunnerCapabilities, tiny_pipeline

from .common import Options, fmt, md_table, shared_pipeline, spread, spread_p99
from .peers import sd_request, step_in_progress
from .plot import PEER_COLORS, figure

__all__ = [
    "BlockClock",
    "NoCancelPoints",
    "deep_wan",
    "plot_substep",
    "run_substep",
    "table_substep",
    "wan_request",
]

SIZE = 128
FRAMES = 17
STEPS = 50
#: The slack the target allows over one block, in milliseconds (targets.py).
TARGET_SLACK_MS = 2.0


class NoCancelPoints(DiffusersRunner):
    """The same runner with its cancel points declared off: aborts land at step ends."""

    @property
    def capabilities(self) -> RunnerCapabilities:
        return dataclasses.replace(super().capabilities, cancel_points=False)


def deep_wan(layers: int) -> Any:
    """A tiny Wan pipeline whose transformer has ``layers`` wider blocks."""
    import torch

    # Untyped: diffusers' constructors carry no annotations.
    diffusers: Any = importlib.import_module("diffusers")
    base = shared_pipeline("wan")
    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=16,
        out_channels=16,
        text_dim=32,  # the tiny UMT5's d_model
        freq_dim=32,
        ffn_dim=512,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    ).eval()
    return diffusers.WanPipeline(**{**base.components, "transformer": transformer})


def wan_request(
    seed: int, steps: int = STEPS, *, size: int = SIZE, frames: int = FRAMES
) -> GenerationRequest:
    """The benchmark's video request (``size`` px square, ``frames`` frames)."""
    return GenerationRequest(
        prompt="a boat crossing a bay",
        negative_prompt="dull",
        num_steps=steps,
        height=size,
        width=size,
        num_frames=frames,
        guidance_scale=5.0,
        seed=seed,
    )


class BlockClock:
    """Hooks that note when each of ``pipe``'s transformer blocks ran: (start, end) spans.

    Registered after the runners' own hooks, so a block left at its cancel point is
    never noted as started.
    """

    def __init__(self, pipe: Any) -> None:
        self.spans: list[tuple[float, float]] = []
        self._started = 0.0
        self._handles = []
        for block in pipe.transformer.blocks:
            self._handles.append(block.register_forward_pre_hook(self._start))
            self._handles.append(block.register_forward_hook(self._end))

    def _start(self, module: Any, args: Any) -> None:
        self._started = time.perf_counter()

    def _end(self, module: Any, args: Any, output: Any) -> None:
        self.spans.append((self._started, time.perf_counter()))

    def durations(self) -> list[float]:
        return [end - start for start, end in self.spans]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _block_times(pipe: Any, steps: int) -> tuple[float, list[float]]:
    """One direct step's duration, and every block's forward duration over ``steps`` steps."""
    runner = DiffusersRunner(pipe)
    clock = BlockClock(pipe)
    state = runner.prepare(wan_request(0, steps + 1), "blocks")
    runner.step([state])  # warm-up
    clock.spans.clear()
    begun = time.perf_counter()
    for _ in range(steps):
        runner.step([state])
    step_s = (time.perf_counter() - begun) / steps
    clock.remove()
    runner.discard(state)
    runner.close()
    return step_s, clock.durations()


def _layers_for(step_target_s: float) -> int:
    probe_layers = 4
    step_s, _ = _block_times(deep_wan(probe_layers), 1)
    return max(probe_layers, round(step_target_s / (step_s / probe_layers)))


async def _trials(pipe: Any, trials: int, step_s: float) -> dict[str, list[float]]:
    rng = random.Random(0)
    out: dict[str, list[float]] = {
        "cancel_points": [],
        "step_end": [],
        "steps_done": [],
        "after_block": [],
    }
    config = EngineConfig(max_batch_size=1)
    async with (
        open_engine(DiffusersRunner(pipe), config) as on,
        open_engine(NoCancelPoints(pipe), config) as off,
    ):
        clock = BlockClock(pipe)
        try:
            for engine in (on, off):  # warm-up, aborted as the trials are: no decode
                async with engine.submit(wan_request(0), request_id="r") as handle:
                    async for _ in handle:
                        break
                    await engine.abort("r")
            for i in range(trials):
                for name, engine in (("cancel_points", on), ("step_end", off)):
                    async with engine.submit(wan_request(i), request_id="r") as handle:
                        async for event in handle:
                            if event.step >= 1:
                                break
                        await anyio.sleep(rng.random() * step_s)
                        started = time.perf_counter()
                        await engine.abort("r")
                        returned = time.perf_counter()
                        out[name].append(returned - started)
                        if name == "cancel_points" and handle.metrics is not None:
                            out["steps_done"].append(float(handle.metrics.steps_done))
                            # From the end of the block that ran when the abort came.
                            _, boundary = step_in_progress(clock.spans, started)
                            out["after_block"].append(returned - boundary)
                    clock.spans.clear()
        finally:
            clock.remove()
    return out


def _hook_cost(steps: int, *, calls: int) -> dict[str, Any]:
    """Per-step time of tiny SD with the hooks armed vs none, alternating step by step.

    Two pipelines built alike (the same seeded weights), stepped in turn (ABBA, so
    neither always goes first): one whose runner holds the hooks and steps armed, as
    in the engine, one whose runner's hooks were removed. Half the steps each way
    round, so that a difference between the two pipeline objects cancels too.
    Pipelines of their own: another benchmark's runner on the shared one may hold hooks.
    """
    pipes = (tiny_pipeline("sd"), tiny_pipeline("sd"))
    times: dict[str, list[float]] = {"hooks": [], "bare": []}
    ratios: list[float] = []
    hooks = 0
    for hooked_pipe, bare_pipe in (pipes, pipes[::-1]):
        hooked, bare = DiffusersRunner(hooked_pipe), DiffusersRunner(bare_pipe)
        hooks = hooked.cancel_point_count - 1  # the VAE decoder's is not in a step
        bare.close()  # removes its hooks; it steps on
        arms = [
            ("hooks", hooked, hooked.prepare(sd_request(steps + 1, 64), "cost")),
            ("bare", bare, bare.prepare(sd_request(steps + 1, 64), "cost")),
        ]
        phase: dict[str, list[float]] = {"hooks": [], "bare": []}
        for _, runner, state in arms:
            runner.step([state])  # warm-up
        with armed(lambda: None):
            for i in range(steps // 2):
                for name, runner, state in arms if i % 2 == 0 else arms[::-1]:
                    started = time.perf_counter()
                    runner.step([state])
                    phase[name].append(time.perf_counter() - started)
        for _, runner, state in arms:
            runner.discard(state)
        hooked.close()
        ratios.append(statistics.median(phase["hooks"]) / statistics.median(phase["bare"]))
        for name in times:
            times[name] += phase[name]
    return {
        "armed_step_s": spread(times["hooks"]),
        "no_hooks_step_s": spread(times["bare"]),
        # The geometric mean of the two ways round.
        "ratio": math.sqrt(ratios[0] * ratios[1]),
        "ratios": ratios,
        "hooks_per_step": hooks,
        "steps": steps,
        "hook_call_us": _hook_call_us(calls),
    }


def _hook_call_us(calls: int) -> float:
    """What one armed hook adds to a module call, in µs: an Identity with it vs without."""
    import torch

    from omni_trio.runners._cancel import hold_cancel_points
    from omni_trio.runners._hooks import ModuleHooks

    module = torch.nn.Identity()
    x = torch.zeros(1)

    def per_call() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            module(x)
        return (time.perf_counter() - started) / calls

    bare = min(per_call() for _ in range(3))
    points = ModuleHooks()
    hold_cancel_points(points, [module])
    with armed(lambda: None):
        hooked = min(per_call() for _ in range(3))
    points.close()
    return (hooked - bare) * 1e6


def run_substep(options: Options) -> dict[str, Any]:
    """Abort latency inside a ~1 s step, with and without cancel points; the hooks' cost."""
    quick = options.quick
    trials = 1 if quick else 24
    # Quick: a fixed depth, no calibration (seconds matter more than the step's length).
    layers = 4 if quick else _layers_for(1.0)
    pipe = deep_wan(layers)
    step_s, blocks = _block_times(pipe, 1 if quick else 3)
    data = options.run(_trials, pipe, trials, step_s)
    block_ms = statistics.median(blocks) * 1e3
    on = spread_p99([v * 1e3 for v in data["cancel_points"]])
    off = spread_p99([v * 1e3 for v in data["step_end"]])
    after_block = spread_p99([v * 1e3 for v in data["after_block"]])
    cost = _hook_cost(4 if quick else 400, calls=2_000 if quick else 20_000)
    cost_pct = (cost["ratio"] - 1) * 100
    no_hooks_ms = cost["no_hooks_step_s"]["median"] * 1e3
    estimate_pct = cost["hook_call_us"] * cost["hooks_per_step"] / (no_hooks_ms * 1e3) * 100
    return {
        "config": {
            "model": f"tiny wan, {layers} blocks (dim 128, ffn 512)",
            "size": SIZE,
            "frames": FRAMES,
            "layers": layers,
            "trials": trials,
            "backend": options.backend,
            "hook_cost_model": "tiny sd, 64 px",
        },
        "step_ms": step_s * 1e3,
        "blocks_ms": spread_p99([b * 1e3 for b in blocks]),
        "abort_ms": {"cancel_points": on, "step_end": off, "after_block": after_block},
        "steps_done_when_aborted": spread(data["steps_done"]),
        "hook_cost": cost,
        "samples_ms": {
            "cancel_points": [v * 1e3 for v in data["cancel_points"]],
            "step_end": [v * 1e3 for v in data["step_end"]],
        },
        "summary": {
            "substep_abort_p99_ms": on["p99"],
            "substep_abort_p50_ms": on["median"],
            "step_end_abort_p99_ms": off["p99"],
            "step_end_abort_p50_ms": off["median"],
            "block_ms": block_ms,
            "step_ms": step_s * 1e3,
            "substep_target_ms": block_ms + TARGET_SLACK_MS,
            "after_block_p99_ms": after_block["p99"],
            "hook_cost_pct": cost_pct,
            "hook_cost_estimate_pct": estimate_pct,
            "hook_call_us": cost["hook_call_us"],
            "hook_step_ms": no_hooks_ms,
        },
    }


def table_substep(result: dict[str, Any]) -> str:
    """Abort latency per arm, in ms and in blocks; the hooks' cost on a UNet step."""
    s = result["summary"]
    block = s["block_ms"]
    rows = []
    for key, label in (
        ("cancel_points", "cancel points (left at the next block)"),
        ("after_block", "cancel points, after the block in progress ended"),
        ("step_end", "cancel points off (the step runs to its end)"),
    ):
        a = result["abort_ms"][key]
        rows.append(
            [
                label,
                f"{int(a['n'])}",
                fmt(a["median"], 1),
                fmt(a["p99"], 1),
                fmt(a["max"], 1),
                fmt(a["p99"] / block, 2),
            ]
        )
    config = result["config"]
    cost = result["hook_cost"]
    blocks = result["blocks_ms"]
    head = (
        f"{config['model']}, {config['size']} px, {config['frames']} frames: a step of"
        f" {result['step_ms']:.0f} ms, blocks of {fmt(blocks['median'])} ms (p99"
        f" {fmt(blocks['p99'])} ms); each request aborted at a random point of a step, after"
        f" its first step event. Target with cancel points: p99 ≤ 1 block + 2 ms ="
        f" {s['substep_target_ms']:.2f} ms.\n\n"
    )
    table = md_table(["abort", "n", "p50 ms", "p99 ms", "max ms", "p99 blocks"], rows)
    tail = (
        f"\n\nHook cost ({config['hook_cost_model']}, {cost['hooks_per_step']} hooked blocks,"
        " the runner's step called directly, armed as in the engine, alternating step by step"
        f" with a bare copy of the pipeline and each way round, {cost['steps']} steps each):"
        " median"
        f" {fmt(cost['armed_step_s']['median'] * 1e3, 3)} ms per step"
        f" with the hooks vs {fmt(cost['no_hooks_step_s']['median'] * 1e3, 3)} ms without:"
        f" {s['hook_cost_pct']:+.2f} % (the geometric mean of the two ways round:"
        f" {', '.join(f'{(r - 1) * 100:+.2f} %' for r in cost['ratios'])}; target ≤ 1 %)."
        " One armed hook adds"
        f" {cost['hook_call_us']:.2f} µs to a module call (an Identity with and without it,"
        f" best of three): {s['hook_cost_estimate_pct']:.3f} % of a step for"
        f" {cost['hooks_per_step']} hooks.\n"
    )
    return head + table + tail


def plot_substep(result: dict[str, Any], path: Path) -> None:
    """Abort latencies of both arms (CDF), against the block and the step."""
    samples = result["samples_ms"]
    s = result["summary"]
    with figure(path, title="substep: abort inside a long step") as (ax,):
        for key, label, color in (
            ("cancel_points", "cancel points", PEER_COLORS["omni_trio"]),
            ("step_end", "at the step's end", PEER_COLORS["naive"]),
        ):
            values = sorted(samples[key])
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, fractions, where="post", label=label, color=color)
        ax.axvline(s["substep_target_ms"], color="k", linestyle="--", linewidth=1, label="target")
        ax.axvline(s["step_ms"], color="#7f7f7f", linestyle=":", linewidth=1, label="one step")
        ax.set_xscale("log")
        ax.set_xlabel("abort call, ms")
        ax.set_ylabel("fraction of aborts")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
