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

from ..serve._options import ServiceOptions
from ..serve.jobs import StoreOpenError
from ._declare import add_options
from ._env import read_environment, resolve_environment
from ._errors import EXIT_ERROR, CommandError
from ._given import refuse_unused
from ._logs import configure_logging, log_notes
from ._options import (
    check_model,
    load,
    make_service,
    service_options,
    unused_for_model,
    unused_options,
)
from ._ray import run_ray
from ._serve_table import SERVE_OPTIONS
from ._servers import run_hypercorn, run_uvicorn
from ._sockets import address, check_port

__all__ = ["add_serve_arguments", "run_serve"]

_log = logging.getLogger("omni_trio.serve")

#: Seconds other threads get to end after the server returned (they were told to).
THREAD_EXIT_S = 2.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``serve`` command's options to ``parser``: its table's (``_serve_table``).

    Every option can also come from the environment (``OMNI_TRIO_<OPTION>``, see
    ``_env``); the command line wins.
    """
    add_options(parser, SERVE_OPTIONS, ServiceOptions)
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
