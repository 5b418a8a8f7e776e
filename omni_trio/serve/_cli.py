"""``python -m omni_trio serve``: load a model, serve it, drain on SIGTERM or SIGINT.

Hypercorn runs the app on trio (the default), Uvicorn on asyncio. Either way a
first SIGTERM or SIGINT drains before the server stops listening: ``/health``
turns 503, new requests get 503, running requests get ``--shutdown-grace``
seconds, the rest are cut at their next step. Then the server closes its
connections, the lifespan closes the (already closed) engine, and the process
exits 0. A second signal ends the grace period at once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import FrameType

    from ._app import ImageService

__all__ = ["MODELS", "add_serve_arguments", "run_serve"]

#: Built-in models: tiny real pipelines with random weights, and a fake one for tests.
MODELS = ("tiny-sd", "tiny-sd3", "tiny-flux", "tiny-unet", "fake")

#: Seconds the server waits for connections to finish after the drain, when only
#: sending the last responses remains (picked without measurement).
AFTER_DRAIN_S = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """A runner and the defaults that suit it."""

    runner: Any
    name: str
    description: str
    size: tuple[int, int]
    steps: int
    guidance_scale: float


def _size(text: str) -> tuple[int, int]:
    width, sep, height = text.partition("x")
    try:
        size = int(width), int(height)
    except ValueError:
        size = (0, 0)
    if not sep or min(size) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT, e.g. 64x64, got {text!r}")
    return size


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` command's options to ``parser``."""
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL|PATH",
        help=f"one of {', '.join(MODELS)}, or a local diffusers folder",
    )
    parser.add_argument("--model-name", default=None, help="the id in /v1/models")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--server",
        choices=["hypercorn", "uvicorn"],
        default="hypercorn",
        help="hypercorn runs on trio (default), uvicorn on asyncio",
    )
    limits = parser.add_argument_group("engine and limits")
    limits.add_argument(
        "--max-batch-size", type=int, default=4, help="requests per denoise step (default 4)"
    )
    limits.add_argument(
        "--max-waiting", type=int, default=256, help="queue bound, then 429 (default 256)"
    )
    limits.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds running requests get to finish on shutdown (default 10)",
    )
    limits.add_argument(
        "--max-steps", type=int, default=200, help="largest num_inference_steps (default 200)"
    )
    limits.add_argument(
        "--max-size", type=int, default=2048, help="largest width and height (default 2048)"
    )
    limits.add_argument("--max-n", type=int, default=8, help="most images per request (default 8)")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="larger request bodies get 413 (default 1 MiB)",
    )
    limits.add_argument(
        "--retry-after",
        type=int,
        default=1,
        metavar="S",
        help="Retry-After seconds sent with 429 and 503 (default 1)",
    )
    defaults = parser.add_argument_group("request defaults (by default: what suits the model)")
    defaults.add_argument(
        "--default-size", type=_size, default=None, metavar="WxH", help="size when none is asked"
    )
    defaults.add_argument(
        "--default-steps", type=int, default=None, help="num_inference_steps when none is asked"
    )
    defaults.add_argument(
        "--default-guidance", type=float, default=None, help="guidance_scale when none is asked"
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="simulated compute per step of the fake model (default 0.05)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument("--no-access-log", dest="access_log", action="store_false")


def load_model(spec: str, *, step_seconds: float) -> LoadedModel:
    """Build the runner for ``spec`` (a name in ``MODELS`` or a diffusers folder).

    Raises:
        SystemExit: ``spec`` is neither a known name nor a directory.
    """
    if spec == "fake":
        from ..testing import FakeRunner

        return LoadedModel(
            runner=FakeRunner(step_seconds=step_seconds),
            name="fake",
            description=f"FakeRunner, {step_seconds * 1e3:g} ms per step",
            size=(64, 64),
            steps=20,
            guidance_scale=7.5,
        )
    from .._runner import Runner
    from ..runners import DiffusersRunner, runner_for, tiny_pipeline

    runner: Runner[Any]
    if spec in MODELS:
        pipeline = tiny_pipeline(spec.removeprefix("tiny-"), seed=0)
        runner = DiffusersRunner(pipeline)
        description = f"tiny {type(pipeline).__name__}, random weights"
        steps = 20
        size = (64, 64)
        name = spec
    else:
        path = Path(spec)
        if not path.is_dir():
            raise SystemExit(
                f"--model: {spec!r} is neither one of {', '.join(MODELS)} nor a folder"
            )
        from diffusers import DiffusionPipeline

        loader: Any = DiffusionPipeline.from_pretrained
        pipeline = loader(str(path), local_files_only=True)
        pipeline.set_progress_bar_config(disable=True)
        runner = runner_for(pipeline)
        description = f"{type(pipeline).__name__} from {path}"
        steps = 30
        size = (512, 512)
        name = path.resolve().name
    fixed = runner.capabilities.fixed_size
    if fixed is not None:
        size = (fixed[1], fixed[0])
    guidance = 3.5 if "Flux" in type(pipeline).__name__ else 7.5
    return LoadedModel(
        runner=runner,
        name=name,
        description=description,
        size=size,
        steps=steps,
        guidance_scale=guidance,
    )


def _service(args: argparse.Namespace, model: LoadedModel) -> ImageService:
    from .._config import EngineConfig
    from ._app import ImageService
    from ._config import ServeConfig

    width, height = args.default_size or model.size
    engine_config = EngineConfig(
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        shutdown_grace=args.shutdown_grace,
        max_steps=args.max_steps,
        max_height=args.max_size,
        max_width=args.max_size,
        max_num_images=args.max_n,
    )
    config = ServeConfig(
        model_name=args.model_name or model.name,
        default_width=width,
        default_height=height,
        default_steps=args.default_steps or model.steps,
        default_guidance_scale=(
            model.guidance_scale if args.default_guidance is None else args.default_guidance
        ),
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after,
    )
    return ImageService(model.runner, engine_config=engine_config, config=config)


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _run_hypercorn(service: ImageService, args: argparse.Namespace) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [_bind(args.host, args.port)]
    config.graceful_timeout = AFTER_DRAIN_S
    config.accesslog = "-" if args.access_log else None
    config.errorlog = "-"
    config.loglevel = args.log_level.upper()

    async def main() -> None:
        # Open before serving, so no signal is missed once /health answers.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

            async def next_signal() -> None:
                async for _ in signals:
                    return

            async def shutdown_trigger() -> None:
                await next_signal()
                async with trio.open_nursery() as nursery:

                    async def cut_short() -> None:
                        await next_signal()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(cut_short)
                    await service.drain()
                    nursery.cancel_scope.cancel()

            # hypercorn's ASGI types are narrower than Starlette's; the app is ASGI 3.
            app: Any = service.app
            await serve(app, config, shutdown_trigger=shutdown_trigger)

    trio.run(main)


def _run_uvicorn(service: ImageService, args: argparse.Namespace) -> None:
    import anyio
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """Uvicorn's server, draining the engine before it stops listening.

        Uvicorn installs ``handle_exit`` for SIGINT and SIGTERM. Here it only counts
        the signal (so nothing is re-raised at exit); ``on_tick``, which Uvicorn's
        main task runs every 0.1 s, drains on the first and tells Uvicorn to stop.
        """

        signals = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if not self.signals:
                return False
            async with anyio.create_task_group() as tg:

                async def cut_short() -> None:
                    while self.signals < 2:
                        await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()

                tg.start_soon(cut_short)
                await service.drain()
                tg.cancel_scope.cancel()
            return True

    config = uvicorn.Config(
        service.app,
        host=args.host,
        port=args.port,
        loop="asyncio",
        http="h11",
        ws="none",
        lifespan="on",
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=AFTER_DRAIN_S,
    )
    DrainingServer(config).run()


def run_serve(args: argparse.Namespace) -> int:
    """Run the server with parsed ``args`` until a signal drains it; return the exit status."""
    from ..testing import engine_threads

    model = load_model(args.model, step_seconds=args.step_seconds)
    service = _service(args, model)
    backend = "trio" if args.server == "hypercorn" else "asyncio"
    print(
        f"omni_trio serve: {service.config.model_name} ({model.description}) on"
        f" http://{_bind(args.host, args.port)} with {args.server} ({backend})",
        file=sys.stderr,
        flush=True,
    )
    if args.server == "hypercorn":
        _run_hypercorn(service, args)
    else:
        _run_uvicorn(service, args)
    left = [t.name for t in engine_threads()]
    others = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    print(
        f"omni_trio serve: stopped; engine threads left: {left or 'none'};"
        f" other non-daemon threads: {others or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    return 1 if left or others else 0
