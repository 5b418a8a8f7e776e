"""``python -m omni_trio demo``: generate one image end to end, with a progress bar."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import anyio

from ._config import EngineConfig
from ._engine import open_engine
from ._errors import RequestAbortedError
from ._outputs import RequestMetrics, StepEvent
from ._request import GenerationRequest

__all__ = ["add_demo_arguments", "run_demo"]

KINDS = ("sd", "sd3", "flux", "unet", "fake")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default="sd",
        help="tiny model to build (default sd); 'fake' needs no diffusers at all",
    )
    parser.add_argument(
        "--model", default=None, metavar="PATH", help="a local diffusers folder instead"
    )
    parser.add_argument("--prompt", default="a red flower in a blue vase")
    parser.add_argument("--steps", type=int, default=20, help="denoise steps (default 20)")
    parser.add_argument(
        "--size", type=int, default=None, help="image side in pixels (default 64; unet: 32)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="demo.png", help="where to write the PNG")
    parser.add_argument(
        "--abort-after",
        type=int,
        default=None,
        metavar="K",
        help="abort after step K, to show the abort landing at the next step with no decode",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="simulated compute per step of the fake model (default 0.05)",
    )
    parser.add_argument(
        "--backend", choices=["trio", "asyncio"], default="trio", help="event loop (default trio)"
    )


def _runner(args: argparse.Namespace) -> tuple[Any, str]:
    if args.model is not None:
        from diffusers import DiffusionPipeline

        from .runners import runner_for

        loader: Any = DiffusionPipeline.from_pretrained
        pipeline = loader(args.model, local_files_only=True)
        pipeline.set_progress_bar_config(disable=True)
        return runner_for(pipeline), f"{type(pipeline).__name__} from {args.model}"
    if args.kind == "fake":
        from .testing import FakeRunner

        return FakeRunner(step_seconds=args.step_seconds), "FakeRunner (no weights)"
    from .runners import DiffusersRunner, tiny_pipeline

    pipeline = tiny_pipeline(args.kind, seed=0)
    return DiffusersRunner(pipeline), f"tiny {type(pipeline).__name__}, random weights"


def _bar(event: StepEvent, out: TextIO) -> None:
    width = 30
    done = width * min(event.step, event.total) // event.total
    out.write(f"\r  [{'#' * done}{'.' * (width - done)}] step {event.step}/{event.total}")
    out.flush()


def _print_metrics(metrics: RequestMetrics, out: TextIO) -> None:
    out.write(f"  queue wait     {metrics.queue_wait_s * 1e3:9.2f} ms\n")
    out.write(f"  execution      {metrics.exec_s * 1e3:9.2f} ms\n")
    out.write(f"  output ready   {metrics.output_ready_wait_s * 1e3:9.2f} ms\n")
    for stage, seconds in metrics.stage_durations.items():
        out.write(f"    {stage:<12} {seconds * 1e3:9.2f} ms\n")
    out.write(f"  steps done     {metrics.steps_done:9d}\n")
    out.write(f"  total          {metrics.total_s * 1e3:9.2f} ms\n")
    if metrics.abort_latency_s is not None:
        out.write(f"  abort latency  {metrics.abort_latency_s * 1e3:9.2f} ms\n")


async def _demo(args: argparse.Namespace, out: TextIO) -> int:
    runner, description = _runner(args)
    fixed = runner.capabilities.fixed_size
    size = args.size or (fixed[0] if fixed else 64)
    request = GenerationRequest(
        prompt=args.prompt, num_steps=args.steps, height=size, width=size, seed=args.seed
    )
    out.write(f"omni_trio demo: {args.steps} steps at {size}x{size}, seed {args.seed}\n")
    out.write(f"  model: {description}\n")
    async with open_engine(runner, EngineConfig()) as engine:
        async with engine.submit(request, request_id="demo") as handle:
            async for event in handle:
                _bar(event, out)
                if args.abort_after is not None and event.step >= args.abort_after:
                    out.write(f"\n  aborting after step {event.step}...")
                    await handle.abort()
                    break
            out.write("\n")
            try:
                output = await handle.result()
            except RequestAbortedError as exc:
                assert handle.metrics is not None
                out.write(f"  aborted ({exc.reason}) after step {handle.metrics.steps_done}; ")
                out.write(f"decodes run: {getattr(runner, 'decodes', 0)}\n")
                _print_metrics(handle.metrics, out)
                return 0
        output.to_pil()[0].save(args.out)
        out.write(f"  wrote {args.out} ({output.images.shape[-1]}x{output.images.shape[-2]})\n")
        _print_metrics(output.metrics, out)
    return 0


def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo with parsed ``args``; return the exit status."""
    result: int = anyio.run(_demo, args, out, backend=args.backend)
    return result
