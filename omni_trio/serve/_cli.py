"""``python -m omni_trio serve``: load a model, serve it, drain on SIGTERM or SIGINT.

Hypercorn runs the app on trio (the default), Uvicorn on asyncio. Either way a
first SIGTERM or SIGINT drains before the server stops listening: ``/health``
turns 503, new requests get 503, running requests get ``--shutdown-grace``
seconds, the rest are cut at their next step. Then the server stops listening
and the last responses get ``--close-timeout`` seconds to reach their clients;
connections still open after that are aborted (``_sockets``), whatever their
clients do, so the lifespan closes the (already closed) engine and the process
exits 0 in bounded time. Each further signal ends the current stage at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable, Callable, Collection
    from types import FrameType

    from ._app import ImageService

__all__ = ["MODELS", "add_serve_arguments", "run_serve"]

#: Built-in models: tiny real pipelines with random weights, and a fake one for tests.
MODELS = ("tiny-sd", "tiny-sd3", "tiny-flux", "tiny-unet", "fake")

_log = logging.getLogger("omni_trio.serve")

#: Seconds the server's own shutdown timeout (Hypercorn's ``graceful_timeout``,
#: Uvicorn's ``timeout_graceful_shutdown``) runs past ``--close-timeout``: a backstop
#: that should never fire, since the connections are aborted at ``--close-timeout``.
BACKSTOP_S = 1.0

#: Seconds other threads get to end after the server returned (they were told to).
THREAD_EXIT_S = 2.0


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


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
        "--close-timeout",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds the last responses get to reach their clients after the drain;"
        " connections still open then are aborted (default 5)",
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


def _log_to_stderr(level: str) -> None:
    """Send the library's log (``omni_trio.*``: failed requests, aborted connections) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    library = logging.getLogger("omni_trio")
    library.addHandler(handler)
    library.setLevel(level.upper())


def _bind(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _cut_short_by(
    next_signal: Callable[[], Awaitable[None]], stage: Callable[[], Awaitable[None]]
) -> None:
    """Run ``stage`` until it returns or the next signal arrives, whichever is first."""
    import anyio

    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await next_signal()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await stage()
        tg.cancel_scope.cancel()


async def _close_stage(
    ports: Collection[int], close_s: float, next_signal: Callable[[], Awaitable[None]]
) -> None:
    """After the drain: give the last responses ``close_s`` s, then abort what is still open.

    Cancellation:
        The caller cancels it once the server closed all its connections by
        itself; then nothing is aborted.
    """
    import anyio

    from ._sockets import abort_connections

    await _cut_short_by(next_signal, lambda: anyio.sleep(close_s))
    aborted = abort_connections(ports)
    if aborted:
        _log.warning(
            "aborted %d connection(s) still open %g s after the drain (--close-timeout)",
            aborted,
            close_s,
        )


def _bound_port(address: str) -> int:
    """The port of Hypercorn's ``http://HOST:PORT`` (``[::1]`` included)."""
    return int(address.rsplit(":", 1)[1])


def _run_hypercorn(service: ImageService, args: argparse.Namespace) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [_bind(args.host, args.port)]
    config.graceful_timeout = args.close_timeout + BACKSTOP_S
    config.accesslog = "-" if args.access_log else None
    config.errorlog = "-"
    config.loglevel = args.log_level.upper()
    # hypercorn's ASGI types are narrower than Starlette's; the app is ASGI 3.
    app: Any = service.app

    async def main() -> None:
        # Open before serving, so no signal is missed once /health answers.
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:

            async def next_signal() -> None:
                async for _ in signals:
                    return

            drained = trio.Event()

            async def shutdown_trigger() -> None:
                await next_signal()
                await _cut_short_by(next_signal, service.drain)
                drained.set()  # returning makes Hypercorn stop listening and close

            async with trio.open_nursery() as nursery:

                async def serving(task_status: trio.TaskStatus[list[str]]) -> None:
                    await serve(
                        app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
                    )
                    nursery.cancel_scope.cancel()  # every connection closed: nothing to abort

                binds: list[str] = await nursery.start(serving)
                await drained.wait()
                # Hypercorn writes to a socket in a shielded scope: a client that stops
                # reading would hold its connection, and this shutdown, forever.
                ports = {_bound_port(bind) for bind in binds}
                await _close_stage(ports, args.close_timeout, next_signal)

    trio.run(main)


def _run_uvicorn(service: ImageService, args: argparse.Namespace) -> None:
    import anyio
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """Uvicorn's server, draining the engine before it stops listening.

        Uvicorn installs ``handle_exit`` for SIGINT and SIGTERM. Here it only counts
        the signal (so nothing is re-raised at exit); ``on_tick``, which Uvicorn's
        main task runs every 0.1 s, drains on the first and tells Uvicorn to stop;
        ``shutdown`` aborts the connections still open after ``--close-timeout``.
        """

        signals = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1

        async def next_signal(self) -> None:
            seen = self.signals
            while self.signals == seen:
                await anyio.sleep(0.05)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if not self.signals:
                return False
            await _cut_short_by(self.next_signal, service.drain)
            return True

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            ports = {sock.getsockname()[1] for server in self.servers for sock in server.sockets}
            async with anyio.create_task_group() as tg:
                # Uvicorn's own timeout cancels the app's tasks, logging a traceback
                # for each; aborting first lets them end as disconnects.
                tg.start_soon(_close_stage, ports, args.close_timeout, self.next_signal)
                await super().shutdown(sockets)
                tg.cancel_scope.cancel()

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
        timeout_graceful_shutdown=math.ceil(args.close_timeout + BACKSTOP_S),
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
    _log_to_stderr(args.log_level)
    if args.server == "hypercorn":
        _run_hypercorn(service, args)
    else:
        _run_uvicorn(service, args)
    left = [t.name for t in engine_threads()]
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    # AnyIO's asyncio worker threads (image encoding) are told to stop when the
    # event loop's main task ends, and end a moment later.
    deadline = time.monotonic() + THREAD_EXIT_S
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    others = [t for t in others if t.is_alive()]
    print(
        f"omni_trio serve: stopped; engine threads left: {left or 'none'};"
        f" other non-daemon threads: {[t.name for t in others] or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    return 1 if left or others else 0
