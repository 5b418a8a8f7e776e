"""``omni-trio serve --ray``: the same server, N replicas on Ray Serve.

Without ``--ray-address`` the command starts a local Ray cluster bound to loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; usage stats off), deploys ``--replicas``
replicas of the model (each its own engine, see ``omni_trio.serve.ray``) behind Ray
Serve's HTTP proxy on ``--host:--port``, and on the first SIGTERM or SIGINT
deletes the application (each replica drains: Ray waits for its requests, then
the engine's shutdown sequence runs), stops the local cluster, and exits 0 with no
Ray process left. With ``--ray-address`` it joins that cluster and, on a signal,
deletes only its own application.

The shutdown needs Ray's own processes (the GCS, the raylet and its helpers) alive
until it is done, and they share the command's process group: a SIGTERM sent to
the whole group (``timeout``, ``kill -- -PGID``, a supervisor) killed them at once,
and Ray Serve's controller then waited 30 s for them before giving up. So on Linux
the command runs Ray in a child of its own session (``_in_own_session``): the
command's process only relays SIGTERM and SIGINT to it, once per signal, and exits
with its status; the child, and so Ray, dies with it if it is killed.

Ray is imported only here, only with ``--ray``: the options exist without the extra,
so that ``--ray`` without it is a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from ..serve._models import MODELS, is_video_model
from ..serve._options import ServiceOptions, build_service
from ..serve.jobs import DEFAULT_JOBS_LEASE_S
from ._errors import EXIT_ERROR, CommandError, UsageError, exit_status_for, reported, summary
from ._given import refuse_unused
from ._logs import configure_logging, log_notes
from ._options import check_model, load, make_service, service_options, unused_for_model
from ._sockets import address, check_port

__all__ = ["APP_NAME", "RAY_ENVIRONMENT", "run_ray"]

_log = logging.getLogger("omni_trio.serve")

#: The Serve application's name (and its deployment's).
APP_NAME = "omni_trio"

#: Set (unless already set) before Ray is imported: keep a local cluster on
#: loopback, and send no usage statistics anywhere.
RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}

RAY_EXTRA_PIP = "pip install 'omni_trio[ray]'"


def _options(args: argparse.Namespace) -> ServiceOptions:
    """The service options of ``args``, checked as far as they can be before Ray starts.

    Raises:
        UsageError: an option is wrong (``--port 0``, ``--model``, ...).
        CommandError: the ray extra is missing, or the port cannot be bound.
    """
    if importlib.util.find_spec("ray") is None:
        raise CommandError(f"--ray needs the 'ray' extra (ray is missing): {RAY_EXTRA_PIP}")
    if args.port == 0:
        raise UsageError("--port: Ray Serve's proxy needs a fixed port with --ray, not 0")
    check_model(args.model)
    options = service_options(args)
    durable = options.jobs_db is not None or options.jobs_dir is not None
    if durable and is_video_model(args.model):
        # One store that every replica shares (L79): a database any node reaches (L98),
        # or a folder, and then the replicas run on the head node, which holds it.
        lease = options.jobs_lease_s if options.jobs_lease_s is not None else DEFAULT_JOBS_LEASE_S
        options = dataclasses.replace(options, jobs_lease_s=lease)
    else:
        options = dataclasses.replace(options, jobs_dir=None, jobs_db=None, jobs_lease_s=None)
    if args.ray_address is None:
        check_port(args.host, args.port)
    return options


def _start_ray(args: argparse.Namespace) -> None:
    """Start a local cluster on loopback, or join ``--ray-address``'s."""
    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ray

    if args.ray_address is None:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            # Every replica schedules on this one node, whatever its core count.
            num_cpus=max(os.cpu_count() or 1, args.replicas),
        )
    else:
        ray.init(address=args.ray_address)


def _deploy(args: argparse.Namespace, options: ServiceOptions) -> None:
    """Deploy ``--replicas`` replicas, each building its service from ``options``.

    Raises:
        UsageError: the replicas need more GPUs than the cluster has.
        CommandError: the deployment fails (a replica did not start).
    """
    import ray
    from ray import serve

    from ..serve.ray import application

    available = ray.cluster_resources().get("GPU", 0.0)
    if args.replica_gpus * args.replicas > available:
        raise UsageError(
            f"--replica-gpus: {args.replicas} replicas of {args.replica_gpus:g} GPUs need"
            f" {args.replicas * args.replica_gpus:g}; the cluster has {available:g}"
        )
    serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
    engine_config = options.engine_config
    app = application(
        functools.partial(build_service, options),
        shutdown_grace=engine_config.shutdown_grace,
        max_ongoing_requests=engine_config.max_batch_size + engine_config.max_waiting,
        num_replicas=args.replicas,
        ray_actor_options={"num_gpus": args.replica_gpus} if args.replica_gpus else None,
        name=APP_NAME,
        shares_jobs=options.jobs_dir is not None and options.jobs_db is None,
    )
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except Exception as exc:  # a replica that did not start: Ray says why in its log
        raise CommandError(f"--ray: the deployment failed: {summary(exc)}") from exc


#: The signals that stop the server (and that ``_in_own_session`` relays).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: ``prctl``'s option that sends the calling process a signal when its parent dies.
_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Have this process get SIGTERM (and so drain) when ``parent`` dies; Linux only.

    Exits at once if ``parent`` died already (the child's parent is then another).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        _log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent:
        os._exit(EXIT_ERROR)


def _in_own_session(run: Callable[[], int], *, debug: bool) -> int:
    """Run ``run`` in a child process of a session of its own; return its exit status.

    Signals sent to this process's group reach this process only; it relays each
    SIGTERM and SIGINT to the child. The child reports an error as ``main`` does
    and never returns here: it exits (``os._exit``) with ``run``'s status.

    Where the child cannot be made that way (not Linux, or threads already running,
    which a fork would not copy), ``run`` runs here, its errors raised.

    Args:
        run: what the child does.
        debug: print an error's traceback too (``--debug``).
    """
    if not (sys.platform.startswith("linux") and threading.active_count() == 1):
        return run()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the child writes what is buffered again
    # Blocked until the relay is in place: a signal meanwhile is relayed, not lost.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        status = EXIT_ERROR
        try:
            os.setsid()
            _die_with(parent)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            status = reported(run, debug=debug)
        finally:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(status)

    def relay(signum: int, frame: FrameType | None) -> None:
        os.kill(child, signum)

    previous = {sig: signal.signal(sig, relay) for sig in _STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        _, status = os.waitpid(child, 0)  # retried after each relayed signal (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else exit_status_for(-code)


@contextmanager
def _signals() -> Iterator[Callable[[], None]]:
    """Catch SIGTERM and SIGINT in the block; yield a function that waits for the first.

    A later signal is logged: Ray Serve's shutdown is not cut short.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            name = signal.Signals(signum).name
            _log.warning("%s again: Ray Serve's shutdown goes on (the replicas drain)", name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in _STOP_SIGNALS}

    def wait() -> None:
        # Ray's core worker may install its own C-level SIGTERM handler after ours
        # (it exits at once, leaving the cluster up): ours is put back meanwhile.
        while not stop.wait(0.5):
            for sig in previous:
                signal.signal(sig, on_signal)

    try:
        yield wait
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_ray(
    args: argparse.Namespace, *, from_environment: Collection[str], notes: Sequence[str]
) -> int:
    """Serve ``args`` on Ray Serve until a signal; return the exit status.

    What can be checked in a moment is, here; the rest runs in a child of its own
    session (``_in_own_session``), which reports its own errors.

    Args:
        args: ``serve``'s parsed arguments, their variables resolved.
        from_environment: the ``dest`` of each option whose value came from its variable.
        notes: what to log once the log is set up (the variables ignored so far).

    Raises:
        UsageError: an option is wrong (``--port 0``).
        CommandError: the ray extra is missing, or the port cannot be bound.
    """
    options = _options(args)

    def serving() -> int:
        return _serve(args, options, from_environment=from_environment, notes=notes)

    return _in_own_session(serving, debug=getattr(args, "debug", False))


def _serve(
    args: argparse.Namespace,
    options: ServiceOptions,
    *,
    from_environment: Collection[str],
    notes: Sequence[str],
) -> int:
    """Start Ray, deploy, wait for a signal, shut down; return the exit status.

    Raises:
        UsageError: more GPUs than the cluster has, or an option given that does not
            apply to the model (a built-in one: checked here).
        CommandError: the deployment fails.
    """
    # The fake model needs no model library (nor torch).
    configure_logging(args.log_level, args.log_format, model_libraries=args.model != "fake")
    log_notes(notes)
    if args.model in MODELS:
        # The built-in models load in a moment: check the options against one here,
        # so a bad one is a usage error now, not a failed deployment.
        here = dataclasses.replace(options, devices=None)
        model = load(here)
        log_notes(refuse_unused(args, unused_for_model(model), from_environment=from_environment))
        make_service(here, model)
    local = args.ray_address is None
    _start_ray(args)
    import ray
    from ray import serve

    with _signals() as wait_for_signal:
        try:
            _deploy(args, options)
            _log.info(
                "serving %s with %d replica(s) on Ray Serve (%s) at http://%s",
                args.model,
                args.replicas,
                "a local cluster" if local else args.ray_address,
                address(args.host, args.port),
            )
            if options.jobs_db is not None:
                _log.info(
                    "video jobs are kept in PostgreSQL (--jobs-db), shared by the replicas on"
                    " any node: a job whose replica stopped is taken over after %g s"
                    " (--jobs-lease)",
                    options.jobs_lease_s,
                )
            elif options.jobs_dir is not None:
                _log.info(
                    "video jobs are kept in %s (--jobs-dir), shared by the replicas on the head"
                    " node: a job whose replica stopped is taken over after %g s (--jobs-lease)",
                    options.jobs_dir,
                    options.jobs_lease_s,
                )
            wait_for_signal()
            _log.info("stopping: the replicas drain, then the engines shut down")
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    _log.info("stopped%s", "; the local Ray cluster is down" if local else "")
    return 0
