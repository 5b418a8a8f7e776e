"""Run a service under Hypercorn (trio) or Uvicorn (asyncio), draining on SIGTERM or SIGINT.

A first signal drains before the server stops listening: ``/health`` turns 503,
new requests get 503, running requests get ``--shutdown-grace`` seconds, the rest
are cut at their next step. Then the server stops listening and the last
responses get ``--close-timeout`` seconds to reach their clients; connections
still open after that are aborted (``_sockets``), whatever their clients do, so
the lifespan closes the (already closed) engine and the server returns in
bounded time. Each further signal ends the current stage at once, and says so in
the log; a drain cut short still logs what it ended with.

A step that never returns (a model call with no cancel point, stuck inside one
block) holds its worker thread, which nothing can kill, and with it the engine's
shutdown. So the first signal also arms a hard bound (``arm_hard_exit``): if the
engine's threads still run ``--shutdown-grace + --stop-timeout + EXIT_MARGIN_S``
seconds later (the engine logged its stuck workers at ``--stop-timeout`` after the
cut), the server logs which request holds which worker, flushes its logs and ends
the process with status 1 (``os._exit``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._threads import engine_threads
from ._errors import EXIT_ERROR
from ._sockets import address

if TYPE_CHECKING:
    import socket
    from collections.abc import Collection
    from types import FrameType

    from ..serve._app import Service

__all__ = ["BACKSTOP_S", "EXIT_MARGIN_S", "arm_hard_exit", "run_hypercorn", "run_uvicorn"]

_log = logging.getLogger("omni_trio.serve")

#: Seconds the server's own shutdown timeout (Hypercorn's ``graceful_timeout``,
#: Uvicorn's ``timeout_graceful_shutdown``) runs past ``--close-timeout``: a backstop
#: that should never fire, since the connections are aborted at ``--close-timeout``.
BACKSTOP_S = 1.0

#: Seconds past ``--shutdown-grace + --stop-timeout`` before a server whose engine
#: threads still run leaves by itself: the engine's own log of its stuck workers
#: (at ``--stop-timeout``) comes first, with room for a step that ends just then.
EXIT_MARGIN_S = 2.0


def exit_bound_s(args: argparse.Namespace) -> float:
    """Seconds from the first signal after which a server that has not stopped leaves."""
    return float(args.shutdown_grace + args.stop_timeout + EXIT_MARGIN_S)


def arm_hard_exit(service: Service, bound_s: float) -> None:
    """From now on: if the engine's threads still run ``bound_s`` seconds later, leave.

    A daemon timer thread, so that neither a busy event loop nor a stuck worker
    delays it, and nothing waits for it at a normal exit.
    """
    timer = threading.Timer(bound_s, _leave, args=(service, bound_s))
    timer.name = "serve-exit-bound"  # not an engine thread: no ENGINE_THREAD_PREFIX
    timer.daemon = True
    timer.start()


def _leave(service: Service, bound_s: float) -> None:
    """Log what holds the engine, flush the logs and end the process with ``EXIT_ERROR``.

    Nothing is left to do when the engine's threads ended: the rest of the
    shutdown is bounded by ``--close-timeout``.
    """
    left = engine_threads()
    if not left:
        return
    engine = service.engine
    # Read from this thread: the figures are single references, swapped whole.
    workers = engine.statistics().workers if engine is not None else ()
    for worker in workers:
        if worker.holding:
            in_step = "" if worker.in_step_s is None else f", {worker.in_step_s:.1f} s in its step"
            _log.error(
                "shutdown: worker %s still holds %s%s",
                worker.name,
                ", ".join(worker.holding),
                in_step,
                extra={"request_ids": worker.holding, "worker": worker.name},
            )
    _log.error(
        "shutdown did not end %g s after the signal (--shutdown-grace + --stop-timeout + %g s):"
        " exiting with status %d; engine threads left: %s",
        bound_s,
        EXIT_MARGIN_S,
        EXIT_ERROR,
        ", ".join(thread.name for thread in left),
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's exit would join the stuck thread, forever.
    os._exit(EXIT_ERROR)


#: Waits for the next SIGTERM or SIGINT; returns its number.
NextSignal = Callable[[], Awaitable[int]]


async def _cut_short_by(
    next_signal: NextSignal, stage: Callable[[], Awaitable[None]], *, cut: str
) -> bool:
    """Run ``stage`` until it returns or the next signal arrives, whichever is first.

    Returns:
        Whether the signal cut it short; then ``cut`` (what that does) was logged.
    """
    import anyio

    signals: list[int] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            signals.append(await next_signal())
            _log.warning("%s again: %s", signal.Signals(signals[0]).name, cut)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await stage()
        tg.cancel_scope.cancel()
    return bool(signals)


async def _drain(service: Service, next_signal: NextSignal) -> None:
    """``service.drain()``, its grace period cut short by the next signal.

    A drain cut short does not log its summary: the engine's statistics, final
    once the cut drain returned, are logged here instead.
    """
    cut = "the grace period ends now; running requests stop at their next step"
    if await _cut_short_by(next_signal, service.drain, cut=cut) and service.engine is not None:
        stats = service.engine.statistics()
        _log.info(
            "drained, cut short: %d completed, %d aborted, %d failed in all",
            stats.completed,
            stats.aborted,
            stats.failed,
        )


async def _close_stage(ports: Collection[int], close_s: float, next_signal: NextSignal) -> None:
    """After the drain: give the last responses ``close_s`` s, then abort what is still open.

    Cancellation:
        The caller cancels it once the server closed all its connections by
        itself; then nothing is aborted.
    """
    import anyio

    from ._sockets import abort_connections

    cut = "the connections still open are aborted now"
    await _cut_short_by(next_signal, lambda: anyio.sleep(close_s), cut=cut)
    aborted = abort_connections(ports)
    if aborted:
        _log.warning(
            "aborted %d connection(s) still open %g s after the drain (--close-timeout)",
            aborted,
            close_s,
        )


#: The most the lifespan's start (the model's warm-up, its compiles) may take: a day.
STARTUP_TIMEOUT_S = 24 * 3600.0


def _bound_port(address: str) -> int:
    """The port of Hypercorn's ``http://HOST:PORT`` (``[::1]`` included)."""
    return int(address.rsplit(":", 1)[1])


def run_hypercorn(service: Service, args: argparse.Namespace) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [address(args.host, args.port)]
    config.graceful_timeout = args.close_timeout + BACKSTOP_S
    # The lifespan's start holds the warm-up, which a cold compile makes minutes long
    # (L90; 84 s measured for a quantized tiny Flux): Hypercorn's 60 s would end it.
    config.startup_timeout = STARTUP_TIMEOUT_S
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

            async def next_signal() -> int:
                async for signum in signals:
                    return signum
                raise AssertionError("a signal receiver never ends")

            drained = trio.Event()

            async def shutdown_trigger() -> None:
                await next_signal()
                arm_hard_exit(service, exit_bound_s(args))
                await _drain(service, next_signal)
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


def run_uvicorn(service: Service, args: argparse.Namespace) -> None:
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
        last_signal = 0

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1
            self.last_signal = sig

        async def next_signal(self) -> int:
            seen = self.signals
            while self.signals == seen:
                await anyio.sleep(0.05)
            return self.last_signal

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if not self.signals:
                return False
            arm_hard_exit(service, exit_bound_s(args))
            await _drain(service, self.next_signal)
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
