"""``python -m omni_trio serve``: check the options, load a model, serve it until a signal.

Everything that can be checked before serving is, each mistake one line: the
options and their variables (``_env``), the port (``_sockets``), the model and the
defaults against it (``_options``). Then the service runs under Hypercorn (trio)
or Uvicorn (asyncio) and drains on SIGTERM or SIGINT (``_servers``); ``--ray``
serves it on Ray Serve instead (``_ray``). The process exits 0 once every engine
thread and every other thread it started has ended.
"""

from __future__ import annotations

import argparse
import gc
import logging
import threading
import time
from collections.abc import Callable

from .._config import EngineConfig
from .._request import MAX_PRIORITY
from ..serve._models import MODELS
from ..serve.jobs import DEFAULT_JOBS_LEASE_S, StoreOpenError, default_jobs_dir
from ._env import read_environment, resolve_environment
from ._errors import EXIT_ERROR, CommandError
from ._given import refuse_unused
from ._logs import LOG_FORMATS, configure_logging, log_notes
from ._options import (
    PARALLEL_OPTIONS,
    SPLIT_BY_LOAD,
    check_model,
    load,
    make_service,
    service_options,
    unused_for_model,
    unused_options,
)
from ._ray import add_ray_arguments, run_ray
from ._servers import run_hypercorn, run_uvicorn
from ._sockets import address, check_port
from ._types import (
    adapter,
    api_keys,
    bound,
    count,
    finite,
    interval,
    jobs_dir,
    positive,
    seconds,
    size,
    step_cache,
    threshold,
)

__all__ = ["add_serve_arguments", "run_serve"]

_log = logging.getLogger("omni_trio.serve")

#: Seconds other threads get to end after the server returned (they were told to).
THREAD_EXIT_S = 2.0


class _AppendKeys(argparse.Action):
    """``append``, where the command line replaces a default from the environment.

    argparse's own ``append`` would append to the variable's value (``_env``): the
    command line wins, as for every other option.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(given if isinstance(given, list) else ()), values])


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
    ranks = parser.add_argument_group(
        "several ranks on one request (one worker, N processes: faster requests, not more)"
    )
    layout = ranks.add_mutually_exclusive_group()
    for option, what in PARALLEL_OPTIONS.items():
        layout.add_argument(
            option, type=count(2, 64), default=None, metavar="N", help=f"{what} over N ranks"
        )
    ranks.add_argument(
        SPLIT_BY_LOAD,
        action="store_true",
        help="with --ulysses or --ring: split one request while the batch is smaller than"
        " the ranks, run the batch's rows on their own ranks when it is not",
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
        "--stop-timeout",
        type=seconds,
        default=10.0,
        metavar="S",
        help="seconds past the grace after which the engine logs the workers a step still"
        " holds; 2 s later a server whose engine still runs logs which request holds which"
        " worker and exits with status 1: a hard bound from the first signal, whatever a"
        " step does (default 10)",
    )
    limits.add_argument(
        "--close-timeout",
        type=seconds,
        default=5.0,
        metavar="S",
        help="seconds the last responses get to reach their clients after the drain;"
        " connections still open then are aborted (default 5)",
    )
    max_step_s = EngineConfig().max_step_s
    limits.add_argument(
        "--max-step-time",
        type=bound,
        default=max_step_s,
        metavar="S|none",
        help="the longest one denoise step of a request alone may take: a request whose"
        " step this server measured (warm, at its size or a smaller one) to take longer is"
        " refused with a 400, since an abort, a deadline or a shutdown lands only at a"
        f" step's end or a cancel point; 'none': no bound (default {max_step_s:g})",
    )
    limits.add_argument(
        "--torch-threads",
        type=count(1, 4096),
        default=None,
        metavar="N",
        help="torch's intra-op threads for the process, shared by every worker (default:"
        " torch's own with one worker; the cores shared out among CPU workers)",
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
    videos.add_argument(
        "--video-bytes",
        type=count(1),
        default=None,
        metavar="BYTES",
        help="most bytes of MP4s held at once; then 429 (default: no bound but --video-jobs)",
    )
    videos.add_argument(
        "--jobs-dir",
        type=jobs_dir,
        default=str(default_jobs_dir()),
        metavar="DIR|none",
        help="folder of the durable job store: jobs and MP4s survive a restart or a crash;"
        " 'none' keeps them in memory (default: $XDG_STATE_HOME/omni-trio/jobs, else"
        " ~/.local/state/omni-trio/jobs)",
    )
    videos.add_argument(
        "--checkpoint-every",
        type=interval,
        default=30.0,
        metavar="S|never",
        help="seconds between two checkpoints of a running job (with --jobs-dir): a crash"
        " redoes at most this much of its steps; 0: every step (default 30)",
    )
    videos.add_argument(
        "--jobs-lease",
        type=positive,
        default=None,
        metavar="S",
        help="share --jobs-dir with the other servers on this host that share it: any of"
        " them serves any job, and one whose server stopped renewing it for S seconds is"
        " taken over from its last checkpoint (default: the folder is this server's"
        f" alone; with --ray, the replicas share it, {DEFAULT_JOBS_LEASE_S:g} s)",
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
    defaults.add_argument(
        "--cache",
        type=step_cache,
        default=None,
        metavar="KIND[:THRESHOLD]",
        help="the step cache of a request that asks for none (L80): first-block[:THRESHOLD]"
        " (default threshold 0.05), taylorseer[:INTERVAL] or none (default: none)",
    )
    adapters = parser.add_argument_group("adapters (LoRA, L85-L88)")
    adapters.add_argument(
        "--adapter",
        type=adapter,
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="load the LoRA file PATH (.safetensors) as NAME at start; repeatable, or"
        " comma-separated",
    )
    adapters.add_argument(
        "--adapter-dir",
        default=None,
        metavar="DIR",
        help="the folder POST /v1/adapters loads from (a client names a file in it)",
    )
    adapters.add_argument(
        "--allow-adapter-admin",
        action="store_true",
        help="load and unload adapters over HTTP (POST /v1/adapters, DELETE"
        " /v1/adapters/NAME); needs --adapter-dir (default: off)",
    )
    parser.add_argument(
        "--step-seconds",
        type=seconds,
        default=0.05,
        help="simulated compute per step of the fake model (default 0.05)",
    )
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="answer at once, without the warm-up request (the fewest steps at the default"
        " size) that measures a step first, so that --max-step-time holds for the first"
        " client's request too (default: a real model warms up)",
    )
    keys = parser.add_argument_group(
        "API keys and tenants (with any key, every route but /health needs one)"
    )
    keys.add_argument(
        # "--api-keys" first: its variable is OMNI_TRIO_API_KEYS, comma-separated.
        "--api-keys",
        "--api-key",
        dest="api_keys",
        action=_AppendKeys,
        type=api_keys,
        default=None,
        metavar="KEY",
        help="accept this key as 'Authorization: Bearer KEY' (repeatable, or several"
        " comma-separated): tenants key1, key2, ..., admin keys (default: none, an open"
        " server)",
    )
    keys.add_argument(
        "--keys-file",
        default=None,
        metavar="PATH",
        help="TOML (.toml) or JSON file of keys (or their sha256:<hex>), each with its"
        " tenant, weight, limits and admin flag (see docs/serving.md)",
    )
    keys.add_argument(
        "--metrics-auth",
        action="store_true",
        help="/metrics needs a key too (default: open, for a scraper)",
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


def run_serve(args: argparse.Namespace) -> int:
    """Run the server with parsed ``args`` until a signal drains it; return the exit status.

    An option given that does not apply (``--replicas`` without ``--ray``,
    ``--video-fps`` with an image model) is a usage error; from its variable, it is
    ignored, and the log says so (``_given``).

    Raises:
        UsageError: an option (or its variable) is wrong, or given and does not apply.
        CommandError: the model does not load, or the port cannot be bound.
    """
    from_environment = resolve_environment(args)
    notes = refuse_unused(args, unused_options(args), from_environment=from_environment)
    if args.ray:
        return run_ray(args, from_environment=from_environment, notes=notes)
    check_model(args.model)
    options = service_options(args)
    check_port(args.host, args.port)
    # Only now: a command that stops at a usage error leaves the logging alone.
    # The fake model needs no model library (nor torch).
    configure_logging(args.log_level, args.log_format, model_libraries=args.model != "fake")
    log_notes(notes)
    model = load(options)
    log_notes(refuse_unused(args, unused_for_model(model), from_environment=from_environment))
    service = make_service(options, model)
    if service.frames is not None:
        try:
            # Before listening: a store that cannot be had is one line and no server.
            service.videos.open_store()
        except StoreOpenError as exc:
            raise CommandError(str(exc)) from exc
    run: Callable[..., None] = run_hypercorn if args.server == "hypercorn" else run_uvicorn
    config = service.config
    _log.info(
        "serving %s (%s; default %dx%d, %d steps, guidance %g) on http://%s with %s (%s)",
        config.model_name,
        model.description,
        config.default_width,
        config.default_height,
        config.default_steps,
        config.default_guidance_scale,
        address(args.host, args.port),
        args.server,
        "trio" if args.server == "hypercorn" else "asyncio",
    )
    if service.frames is not None:
        where = options.jobs_dir
        shared = (
            f", shared with the servers on this host that share it (--jobs-lease"
            f" {options.jobs_lease_s:g})"
            if options.jobs_lease_s is not None
            else ""
        )
        _log.info(
            "video jobs are kept %s",
            "in memory (--jobs-dir none): a restart loses them"
            if where is None
            else f"in {where} (--jobs-dir){shared}",
        )
    try:
        run(service, args)
    except OSError as exc:  # a bind that failed after the check (a race)
        raise CommandError(f"cannot listen on {address(args.host, args.port)}: {exc}") from exc
    finally:
        service.videos.close_store()  # closed already, unless the server never ran
    status = _threads_ended()
    _spare_the_exit()
    return status


def _threads_ended() -> int:
    """Log the threads still alive once the server returned: 0 if none, else ``EXIT_ERROR``."""
    from .._threads import engine_threads

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


def _spare_the_exit() -> None:
    """Freeze every object alive out of the garbage collector: the process is done with them.

    The interpreter's exit runs full collections as it clears its modules, and each
    walked every object torch, diffusers and the servers made (about 440,000 with
    ``tiny-sd``, 0.3 s a walk on this project's 2-core VM): 1.3 to 2.7 s between the
    "stopped" line and the end of the process, longer on a loaded machine. Frozen
    (``gc.freeze``), they are out of those walks; the exit still runs every ``atexit``
    handler and frees each object by its reference count, as before.
    """
    gc.freeze()
