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
import errno
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._request import MAX_PRIORITY
from ..serve._models import FALLBACK_FPS, MODELS, LoadedModel
from ._env import read_environment, resolve_environment
from ._errors import EXIT_ERROR, CommandError, UsageError
from ._logs import LOG_FORMATS, configure_logging
from ._options import check_model, load
from ._ray import add_ray_arguments, run_ray
from ._types import count, finite, positive, seconds, size, threshold

if TYPE_CHECKING:
    import socket
    from collections.abc import Awaitable, Collection
    from types import FrameType

    from ..serve._app import ImageService

__all__ = ["add_serve_arguments", "decode_options", "run_serve"]

_log = logging.getLogger("omni_trio.serve")

#: Seconds the server's own shutdown timeout (Hypercorn's ``graceful_timeout``,
#: Uvicorn's ``timeout_graceful_shutdown``) runs past ``--close-timeout``: a backstop
#: that should never fire, since the connections are aborted at ``--close-timeout``.
BACKSTOP_S = 1.0

#: Seconds other threads get to end after the server returned (they were told to).
THREAD_EXIT_S = 2.0


def decode_options(args: argparse.Namespace) -> dict[str, int | None]:
    """The ``DiffusersRunner`` options of the ``--decode-*`` arguments (L72)."""
    return {
        "tile_above": args.decode_tile_above,
        "framewise_above": args.decode_framewise_above,
    }


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` command's options to ``parser``.

    Every option can also come from the environment (``OMNI_TRIO_<OPTION>``, see
    ``_env``); the command line wins.
    """
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL|PATH",
        help=f"one of {', '.join(MODELS)}, or a local diffusers folder",
    )
    parser.add_argument("--model-name", default=None, help="the id in /v1/models")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port",
        type=count(0, 65535),
        default=8000,
        help="port; 0 picks a free one (default 8000)",
    )
    parser.add_argument(
        "--server",
        choices=["hypercorn", "uvicorn"],
        default="hypercorn",
        help="hypercorn runs on trio (default), uvicorn on asyncio",
    )
    devices = parser.add_argument_group("devices (one worker each, one queue)")
    choice = devices.add_mutually_exclusive_group()
    choice.add_argument(
        "--devices",
        default=None,
        metavar="LIST|auto",
        help="torch devices, comma-separated (cuda:0,cuda:1), or auto: every visible GPU,"
        " else the CPU (default: one worker where the model loads)",
    )
    choice.add_argument(
        "--workers",
        type=count(1, 64),
        default=None,
        metavar="N",
        help="N workers on the CPU, torch's threads shared out among them",
    )
    limits = parser.add_argument_group("engine and limits")
    limits.add_argument(
        "--max-batch-size", type=count(1), default=4, help="requests per denoise step (default 4)"
    )
    limits.add_argument(
        "--max-waiting", type=count(0), default=256, help="queue bound, then 429 (default 256)"
    )
    limits.add_argument(
        "--shutdown-grace",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds running requests get to finish on shutdown (default 10)",
    )
    limits.add_argument(
        "--close-timeout",
        type=seconds,
        default=5.0,
        metavar="S",
        help="seconds the last responses get to reach their clients after the drain;"
        " connections still open then are aborted (default 5)",
    )
    limits.add_argument(
        "--max-steps", type=count(1), default=200, help="largest num_inference_steps (default 200)"
    )
    limits.add_argument(
        "--max-size", type=count(1), default=2048, help="largest width and height (default 2048)"
    )
    limits.add_argument(
        "--max-n", type=count(1), default=8, help="most images per request (default 8)"
    )
    limits.add_argument(
        "--max-body-bytes",
        type=count(1),
        default=1 << 20,
        help="larger request bodies get 413 (default 1 MiB)",
    )
    limits.add_argument(
        "--max-upload-bytes",
        type=count(1),
        default=16 << 20,
        help="larger /v1/images/edits uploads get 413 (default 16 MiB)",
    )
    limits.add_argument(
        "--max-upload-pixels",
        type=count(1),
        default=4096 * 4096,
        help="an uploaded image of more pixels (read from its header, before decoding)"
        " gets 413 (default 4096x4096)",
    )
    limits.add_argument(
        "--retry-after",
        type=count(0),
        default=1,
        metavar="S",
        help="Retry-After seconds sent with 429 and 503 (default 1)",
    )
    limits.add_argument(
        "--max-priority",
        type=count(0, MAX_PRIORITY),
        default=0,
        help="highest priority a request may ask for; more is a 400 (default 0: clients are"
        " anonymous, none may put itself ahead of the others)",
    )
    videos = parser.add_argument_group("video jobs (a video model's /v1/videos)")
    videos.add_argument(
        "--video-jobs",
        type=count(1),
        default=64,
        metavar="N",
        help="most video jobs held at once, finished ones included; then 429 (default 64)",
    )
    videos.add_argument(
        "--video-ttl",
        type=positive,
        default=3600.0,
        metavar="S",
        help="seconds a finished video job (and its MP4) is kept (default 3600)",
    )
    videos.add_argument(
        "--video-fps",
        type=positive,
        default=None,
        metavar="FPS",
        help="frames per second of the MP4s, which turns seconds into frames"
        " (default: the model's; Wan 16, LTX-Video 25)",
    )
    decoding = parser.add_argument_group(
        "decodes in chunks (L72: an abort during a decode lands within one chunk)"
    )
    decoding.add_argument(
        "--decode-tile-above",
        type=threshold,
        default=1024 * 1024,
        metavar="PIXELS|never",
        help="decode a frame of more pixels than this in the VAE's blended tiles"
        " (default 1048576: past 1024x1024)",
    )
    decoding.add_argument(
        "--decode-framewise-above",
        type=threshold,
        default=None,
        metavar="FRAMES|never",
        help="decode a LTX-Video clip of more frames than this in the VAE's blended"
        " temporal chunks (default never: the output then equals the pipeline's call)",
    )
    defaults = parser.add_argument_group("request defaults (by default: what suits the model)")
    defaults.add_argument(
        "--default-size", type=size, default=None, metavar="WxH", help="size when none is asked"
    )
    defaults.add_argument(
        "--default-steps",
        type=count(1),
        default=None,
        help="num_inference_steps when none is asked",
    )
    defaults.add_argument(
        "--default-guidance", type=finite, default=None, help="guidance_scale when none is asked"
    )
    parser.add_argument(
        "--step-seconds",
        type=seconds,
        default=0.05,
        help="simulated compute per step of the fake model (default 0.05)",
    )
    logs = parser.add_argument_group("logging (stderr)")
    logs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    logs.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (default text)",
    )
    logs.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no line per HTTP request",
    )
    add_ray_arguments(parser)
    read_environment(parser)


def _service(args: argparse.Namespace, model: LoadedModel) -> ImageService:
    """The service ``args`` ask for, its defaults checked against the model now.

    Raises:
        UsageError: an option is out of range, or a default the model refuses
            (the message names the option).
    """
    from .._config import EngineConfig
    from .._errors import InvalidRequestError
    from .._request import GenerationRequest
    from ..serve._app import ImageService
    from ..serve._config import ServeConfig

    width, height = args.default_size or model.size
    try:
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
            default_steps=args.default_steps or min(model.steps, args.max_steps),
            default_guidance_scale=(
                model.guidance_scale if args.default_guidance is None else args.default_guidance
            ),
            max_body_bytes=args.max_body_bytes,
            retry_after_s=args.retry_after,
            max_priority=args.max_priority,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from ..serve._video_body import frames_for
    from ..serve._video_jobs import VideoConfig

    frames = model.runners[0].capabilities.frames
    try:
        videos = VideoConfig(
            fps=args.video_fps or model.fps or FALLBACK_FPS,
            max_jobs=args.video_jobs,
            ttl_s=args.video_ttl,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # The defaults are checked once, here, as a request that uses them all.
    try:
        probe = GenerationRequest(
            prompt="-",
            width=config.default_width,
            height=config.default_height,
            num_steps=config.default_steps,
            guidance_scale=config.default_guidance_scale,
            num_frames=(
                None if frames is None else frames_for(videos.default_seconds, videos.fps, frames)
            ),
        )
        engine_config.check_request(probe)
        model.runners[0].capabilities.check_request(probe)
    except InvalidRequestError as exc:
        option = _DEFAULT_OPTIONS.get(exc.field, "--default-size")
        raise UsageError(f"{option}: the model refuses it: {exc}") from None
    runners = model.runners[0] if len(model.runners) == 1 else list(model.runners)
    from ..serve._upload import UploadLimits

    uploads = UploadLimits(max_bytes=args.max_upload_bytes, max_pixels=args.max_upload_pixels)
    return ImageService(
        runners,
        engine_config=engine_config,
        config=config,
        upload_limits=uploads,
        video_config=videos,
    )


# The option that sets each default, to name it in an error.
_DEFAULT_OPTIONS = {
    "num_frames": "--video-fps",
    "width": "--default-size",
    "height": "--default-size",
    "num_steps": "--default-steps",
    "guidance_scale": "--default-guidance",
}


def _check_port(host: str, port: int) -> None:
    """Fail now, in one line, if ``host:port`` cannot be bound (in use, or not an address).

    Raises:
        CommandError: the bind fails; the message says why.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise UsageError(f"--host: cannot listen on {host!r}: {exc.strerror or exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As the servers do: a port left in TIME_WAIT by a previous run is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise CommandError(f"cannot listen on {_bind(host, port)}: {reason}") from None


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
    # Loggers, not "-": their lines go through the one handler (text or JSON).
    config.accesslog = logging.getLogger("hypercorn.access") if args.access_log else None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = args.log_level.upper()
    from ._access import AccessLogger, marking_sent

    config.logger_class = AccessLogger
    # hypercorn's ASGI types are narrower than Starlette's; the app is ASGI 3.
    app: Any = marking_sent(service.app)

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
        log_config=None,  # its lines go through the one handler (text or JSON)
        access_log=args.access_log,
        timeout_graceful_shutdown=math.ceil(args.close_timeout + BACKSTOP_S),
    )
    DrainingServer(config).run()


def _devices(args: argparse.Namespace) -> list[str] | None:
    """The devices ``--devices`` or ``--workers`` name; ``None`` when neither is given.

    Raises:
        UsageError: ``--devices`` names no device, a bad one, or one twice.
    """
    if args.workers is not None:
        return ["cpu"] * args.workers
    if args.devices is None:
        return None
    from ..runners._devices import parse_devices

    try:
        return parse_devices(args.devices)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    """Run the server with parsed ``args`` until a signal drains it; return the exit status.

    Everything that can be checked before serving is: the options (and their
    variables), the port, the model, the defaults against the model.

    Raises:
        UsageError: an option (or its variable) is wrong.
        CommandError: the model does not load, or the port cannot be bound.
    """
    from ..testing import engine_threads

    resolve_environment(args)
    if args.ray:
        return run_ray(args)
    check_model(args.model)
    devices = _devices(args)
    _check_port(args.host, args.port)
    # Only now: a command that stops at a usage error leaves the logging alone.
    configure_logging(args.log_level, args.log_format)
    model = load(
        args.model,
        step_seconds=args.step_seconds,
        max_steps=args.max_steps,
        devices=devices,
        runner_options=decode_options(args),
    )
    service = _service(args, model)
    backend = "trio" if args.server == "hypercorn" else "asyncio"
    config = service.config
    _log.info(
        "serving %s (%s; default %dx%d, %d steps, guidance %g) on http://%s with %s (%s)",
        config.model_name,
        model.description,
        config.default_width,
        config.default_height,
        config.default_steps,
        config.default_guidance_scale,
        _bind(args.host, args.port),
        args.server,
        backend,
    )
    try:
        if args.server == "hypercorn":
            _run_hypercorn(service, args)
        else:
            _run_uvicorn(service, args)
    except OSError as exc:  # a bind that failed after the check (a race)
        raise CommandError(f"cannot listen on {_bind(args.host, args.port)}: {exc}") from exc
    left = [t.name for t in engine_threads()]
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    # AnyIO's asyncio worker threads (image encoding) are told to stop when the
    # event loop's main task ends, and end a moment later.
    deadline = time.monotonic() + THREAD_EXIT_S
    for thread in others:
        thread.join(max(0.0, deadline - time.monotonic()))
    others = [t for t in others if t.is_alive()]
    _log.log(
        logging.WARNING if left or others else logging.INFO,
        "stopped; engine threads left: %s; other non-daemon threads: %s",
        left or "none",
        [t.name for t in others] or "none",
    )
    return EXIT_ERROR if left or others else 0
