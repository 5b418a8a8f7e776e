"""Scale out on Ray Serve: one engine per replica, the same HTTP API, a handle for composition.

Needs the ``ray`` extra (``pip install 'omni_trio[ray]'``); ``import omni_trio`` and
``import omni_trio.serve`` never import Ray.

- ``deployment(model=..., num_replicas=..., ...)`` returns a bound application for
  ``serve.run``: each replica loads the model, opens one engine (the
  ``Service`` lifespan, run by Ray Serve's ASGI ingress) and serves the
  OpenAI-style API of ``omni-trio serve`` unchanged; the model is a name, a
  ``runners.ModelSpec`` (its dtype, compilation, quantization, ... as ``serve``'s
  options give them, L89) or a factory of runners;
- ``ImageDeployment.generate(request)`` (a ``GenerationRequest`` or a dict of its
  fields) is the Python handle method, for other deployments;
- ``DeploymentResponse.cancel()`` on a handle call, and an HTTP client that
  disconnects, abort the request at its next step boundary; the replica's call
  returns only once the worker released it (L11, L51);
- ``deployment(..., jobs_dir=folder)`` (``serve --ray``'s ``--jobs-dir``): a video
  model's replicas share one job store on the head node (L79): any replica serves
  any job, and a dead replica's jobs are taken over from their last checkpoints;
  ``deployment(..., jobs_db=dsn)`` (``--jobs-db``): the same through PostgreSQL
  (L98), the replicas on any node;
- a replica traces its requests (L99) as ``omni-trio serve`` does, configured by the
  ``OTEL_*`` variables of its own environment (``ray_actor_options={"runtime_env":
  {"env_vars": {...}}}``): Ray's proxy hands it the request's headers, so its spans
  continue the client's ``traceparent``.

The engine's lifetime is the replica's: the lifespan opens it when the replica
starts and Ray Serve's destructor runs its shutdown sequence (L30-L35) when the
replica stops, joining its threads. See docs/scaling.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Application

from .._config import EngineConfig
from .._errors import EngineClosedError
from .._outputs import EngineStatistics, GenerationOutput
from .._request import GenerationRequest
from .._runner import Runner
from ._app import Service
from ._config import ServeConfig, with_defaults
from ._keys import ApiKeys
from ._options import ServiceOptions, build_service, spec_options
from ._ray_ingress import REPLICA_HEADER, App, ReplicaIngress
from ._tracing import Tracing
from ._video_body import default_frames
from .jobs import DEFAULT_JOBS_LEASE_S, VideoConfig, postgres_store

if TYPE_CHECKING:
    from ..runners import ModelSpec

__all__ = [
    "DEFAULT_JOBS_LEASE_S",
    "DEFAULT_MAX_QUEUED_REQUESTS",
    "REPLICA_HEADER",
    "SHUTDOWN_MARGIN_S",
    "ImageDeployment",
    "deployment",
]

#: Seconds Ray Serve's ``graceful_shutdown_timeout_s`` runs past the engine's
#: ``shutdown_grace``: time to cut what still runs at a step boundary, answer it and
#: join the engine's threads before the controller kills the replica.
SHUTDOWN_MARGIN_S = 5.0

#: Requests each caller (the HTTP proxy, a handle) queues for the deployment when
#: every replica is full; more get a 503 (``BackPressureError`` through a handle).
#: Ray's own default, -1, queues without bound: a client would wait, never refused.
DEFAULT_MAX_QUEUED_REQUESTS = 16

#: A custom resource Ray gives its head node only: replicas that share a job store's
#: folder are placed there, on the one host that holds the folder (SQLite needs one
#: host's file locks; a network file system does not give them).
HEAD_NODE = "node:__internal_head__"

ServiceFactory = Callable[[], Service]
"""Builds a replica's service on the replica (picklable: it travels to the replica)."""

RunnerFactory = Callable[[], "Runner[Any] | Sequence[Runner[Any]]"]


class _ImageReplica:
    """One replica: the service (its engine opened by the ingress's lifespan) and its handle."""

    def __init__(self, make_service: ServiceFactory) -> None:
        self._service = make_service()
        self.replica_id = serve.get_replica_context().replica_tag

    def __serve_build_asgi_app__(self) -> App:
        app: App = self._service.app
        return ReplicaIngress(app, replica_id=self.replica_id)

    async def generate(
        self, request: GenerationRequest | Mapping[str, Any], *, request_id: str | None = None
    ) -> GenerationOutput:
        """Generate ``request`` on this replica's engine; return its output.

        Args:
            request: a ``GenerationRequest``, taken as it is, or a dict of its
                fields, the fields it leaves out (or ``None``) filled with the
                service's defaults exactly as the HTTP routes fill them (the
                model's size, steps and guidance scale, a video model's default
                length): ``with_defaults``.
            request_id: the engine's id for it (default: a fresh one).

        Raises:
            EngineClosedError: the replica is starting or shutting down.
            InvalidRequestError, QueueFullError, DeadlineError: as ``Engine.submit``.
            RequestAbortedError, RequestFailedError: as ``RequestHandle.result``.

        Cancellation:
            ``DeploymentResponse.cancel()`` (a native cancellation of this call)
            aborts the request at its next step boundary (reason ``cancelled``);
            the call returns only once the worker released it (L11).

        The replica's ``/metrics`` counts the call as its HTTP routes count theirs
        (``Service.generate``).
        """
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(**_filled(request, self._service))
        if not self._service.is_ready:
            raise EngineClosedError(f"replica {self.replica_id} is not serving")
        return await self._service.generate(request, request_id=request_id)

    def statistics(self) -> tuple[str, EngineStatistics | None]:
        """This replica's id and its engine's statistics (``None`` before it opened)."""
        engine = self._service.engine
        return self.replica_id, engine.statistics() if engine is not None else None


def _filled(fields: Mapping[str, Any], service: Service) -> dict[str, Any]:
    """``fields`` with ``service``'s defaults, as its HTTP routes fill a body's."""
    videos = service.videos.config
    frames = default_frames(videos.fps, videos.default_seconds, service.frames)
    return with_defaults(fields, service.config, num_frames=frames)


ImageDeployment = serve.deployment(name="omni_trio")(serve.ingress()(_ImageReplica))
"""The Serve deployment: bind it to a ``ServiceFactory``, or use ``deployment()``."""


def _runner_service(
    make_runners: RunnerFactory,
    engine_config: EngineConfig,
    serve_config: ServeConfig | None,
    keys: ApiKeys | None = None,
    video_config: VideoConfig | None = None,
) -> Service:
    """Call ``make_runners`` here (on the replica) and serve what it returns, traced as
    the replica's ``OTEL_*`` say (L99), as a named model's replica is."""
    config = serve_config if serve_config is not None else ServeConfig()
    return Service(
        make_runners(),
        engine_config=engine_config,
        config=config,
        keys=keys,
        video_config=video_config,
        tracing=Tracing.from_environment(),
    )


def application(
    make_service: ServiceFactory,
    *,
    shutdown_grace: float,
    max_ongoing_requests: int,
    num_replicas: int | str | None = 1,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    ray_actor_options: Mapping[str, Any] | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    name: str = "omni_trio",
    shares_jobs: bool = False,
) -> Application:
    """Bind ``ImageDeployment`` to ``make_service`` with these Serve options.

    Ray Serve's ``graceful_shutdown_timeout_s`` is ``shutdown_grace`` plus
    ``SHUTDOWN_MARGIN_S``. ``shares_jobs``: the replicas share a job store's folder
    (L79), so they are placed on the head node (``HEAD_NODE``), which holds it.
    ``deployment()`` and ``omni-trio serve --ray`` call this.
    """
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "graceful_shutdown_timeout_s": shutdown_grace + SHUTDOWN_MARGIN_S,
        # Ray polls the drain this often; the default (2 s) would add up to 2 s to
        # every shutdown of an idle replica.
        "graceful_shutdown_wait_loop_s": 0.1,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas
    actor = dict(ray_actor_options) if ray_actor_options is not None else {}
    if shares_jobs:
        actor["resources"] = {**actor.get("resources", {}), HEAD_NODE: 0.001}
    if actor:
        options["ray_actor_options"] = actor
    return ImageDeployment.options(**options).bind(make_service)


def _warm_up_config(
    warm_up: bool, sizes: Sequence[tuple[int, int]], serve_config: ServeConfig | None
) -> ServeConfig:
    """``deployment``'s warm-up as the HTTP layer's configuration (its other fields
    ``ServeConfig``'s defaults), checked before anything deploys.

    Raises:
        ValueError: sizes without ``warm_up``, or with ``serve_config`` (which has its
            own), or a size that is not a ``(width, height)`` pair of ints >= 1.
    """
    if (warm_up or sizes) and serve_config is not None:
        raise ValueError("warm_up, warm_up_sizes: serve_config's own are used; set them there")
    if sizes and not warm_up:
        raise ValueError("warm_up_sizes: only with warm_up=True")
    return ServeConfig(warm_up=warm_up, warm_up_sizes=tuple(sizes))


def _spec(model: object) -> dict[str, Any]:
    """The fields of ``ServiceOptions`` of ``model``, a ``ModelSpec`` (``spec_options``).

    Raises:
        TypeError: ``model`` is none of a name, a spec or a function.
        ValueError: as ``spec_options``.
    """
    # Not callable: the caller built a spec, so omni_trio.runners is imported already.
    from ..runners import ModelSpec

    if not isinstance(model, ModelSpec):
        raise TypeError(
            f"model: a name, a folder, a hub id, a ModelSpec or a function, got {model!r}"
        )
    return spec_options(model)


def deployment(
    model: str | ModelSpec | RunnerFactory,
    *,
    devices: Sequence[str] | None = None,
    parallel: tuple[str, int] | None = None,
    split_by_load: bool = False,
    step_seconds: float = 0.05,
    engine_config: EngineConfig | None = None,
    serve_config: ServeConfig | None = None,
    num_replicas: int | str | None = 1,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    ray_actor_options: Mapping[str, Any] | None = None,
    graceful_shutdown_timeout_s: float | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    name: str = "omni_trio",
    keys: ApiKeys | None = None,
    jobs_dir: str | os.PathLike[str] | None = None,
    jobs_db: str | None = None,
    checkpoint_every_s: float | None = 30.0,
    jobs_lease_s: float = DEFAULT_JOBS_LEASE_S,
    warm_up: bool = False,
    warm_up_sizes: Sequence[tuple[int, int]] = (),
) -> Application:
    """A Ray Serve application that serves ``model``, one engine per replica.

    Args:
        model: one of ``omni-trio serve``'s models (``fake``, ``tiny-sd``, ...), a
            diffusers folder or a Hugging Face hub id, loaded on each replica, which
            builds its service as ``omni-trio serve`` does (``build_service``: the
            defaults checked against the model as the replica starts, a video model's
            own frames per second); or a ``runners.ModelSpec`` of one (L89), whose
            fields are ``serve``'s model options (``--revision``, ``--variant``,
            ``--dtype``, ``--attention-backend``, ``--compile``, ``--compile-cache``,
            ``--quantization``, ``--quantize-components``, ``--gguf-file``): each
            replica loads it as ``serve`` would (a hub id through the replica's own
            Hugging Face cache, offline where its ``HF_HUB_OFFLINE`` says so); or a
            picklable function that returns the runner (or one per device), called on
            each replica.
        devices: one runner per device on each replica (``--devices``); with
            ``ray_actor_options={"num_gpus": k}`` Ray shows each replica its k GPUs
            as ``cuda:0`` to ``cuda:k-1``.
        parallel: ``(layout, ranks)`` (``("ulysses", 2)``, as ``serve --ulysses 2``):
            each replica's one worker is a ``ParallelRunner`` over that many ranks,
            processes of the replica's own (``devices`` are then its ranks'), so
            several replicas are several groups behind one proxy (L49); a named
            model only.
        split_by_load: with a token split, choose it per call by load (``by_load``).
        step_seconds: the ``fake`` model's simulated step.
        engine_config: each replica's engine configuration.
        serve_config: the HTTP layer's; by default the model's own defaults (as
            ``omni-trio serve``) for a named model, else ``ServeConfig()``.
        num_replicas: replicas (ignored with ``autoscaling_config``).
        max_ongoing_requests: requests Ray sends one replica at a time; default
            ``max_batch_size + max_waiting``, so every request a replica takes fits
            its engine and waits in the engine's queue (priorities, deadlines).
        max_queued_requests: requests each caller holds when every replica is full;
            more are answered 503 at once (never -1: that would queue forever).
        ray_actor_options: each replica's resources (``{"num_gpus": 1}``).
        graceful_shutdown_timeout_s: the most a stopping replica may take; the
            engine's ``shutdown_grace`` becomes this minus ``SHUTDOWN_MARGIN_S``.
            Default: ``shutdown_grace + SHUTDOWN_MARGIN_S``.
        autoscaling_config: Ray Serve's autoscaling (``min_replicas``,
            ``max_replicas``, ``target_ongoing_requests``, ...).
        name: the deployment's name.
        keys: the API keys every replica's HTTP routes accept (L55, as
            ``Service``'s; only their digests travel). The deployment handle's
            ``generate`` is a call inside the cluster and takes none.
        jobs_dir: a video model's durable job store (L77), one folder that every
            replica shares (L79): any replica reads, lists, downloads and deletes any
            job, and a job whose replica died is taken over by another from its last
            checkpoint. The replicas then run on the head node, which holds the
            folder. ``None``: each replica keeps its jobs in memory.
        jobs_db: a PostgreSQL connection string instead of ``jobs_dir`` (L98): the
            replicas share the jobs, their MP4s and checkpoints through the database,
            on any node (the ``postgres`` extra on each); a factory's replicas too.
        checkpoint_every_s: seconds between a running job's checkpoints (L78).
        jobs_lease_s: seconds a replica holds a job without renewing it before
            another takes it over (a dead replica's jobs wait this long).
        warm_up: each replica runs one request of a few steps before it answers
            (``serve``'s warm-up, on by default there for a real model): the engine's
            ``max_step_s`` then bounds the first client's step too, and a compiled
            model (``compile="blocks"``) compiles before a client waits on it.
        warm_up_sizes: with ``warm_up``, the ``(width, height)`` sizes it runs
            (``serve --warm-up-sizes``; a compiled model's at one and two rows, L90);
            empty: the default size. Both are ``serve_config``'s own when it is given.

    Returns:
        The bound application, for ``serve.run``.

    Raises:
        ValueError: ``max_queued_requests`` is not positive, a negative timeout,
            ``parallel`` with a factory, a ``ModelSpec`` field a served model does not
            take (``component_dtypes``; ``offline``: a replica honours
            ``HF_HUB_OFFLINE`` in its own environment), or ``warm_up_sizes`` without
            ``warm_up`` or with ``serve_config``; the message names it.
        TypeError: ``model`` is none of a name, a ``ModelSpec`` or a function.
    """
    config = engine_config if engine_config is not None else EngineConfig()
    if graceful_shutdown_timeout_s is not None:
        if graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s: must be >= 0")
        grace = max(0.0, graceful_shutdown_timeout_s - SHUTDOWN_MARGIN_S)
        config = dataclasses.replace(config, shutdown_grace=grace)
    if max_queued_requests < 1:
        raise ValueError(
            f"max_queued_requests: must be >= 1 (a bounded queue), got {max_queued_requests}"
        )
    folder = None if jobs_dir is None or jobs_db is not None else os.fspath(jobs_dir)
    lease = jobs_lease_s if folder is not None or jobs_db is not None else None
    warming = _warm_up_config(warm_up, warm_up_sizes, serve_config)
    make: ServiceFactory
    if isinstance(model, str) or not callable(model):
        named = {"model": model} if isinstance(model, str) else _spec(model)
        options = ServiceOptions(
            **named,
            warm_up=warming.warm_up,
            warm_up_sizes=warming.warm_up_sizes,
            devices=None if devices is None else tuple(devices),
            parallel=parallel,
            split_by_load=split_by_load,
            step_seconds=step_seconds,
            engine_config=config,
            keys=keys,
            jobs_dir=folder,
            jobs_db=jobs_db,
            checkpoint_every_s=checkpoint_every_s,
            jobs_lease_s=lease,
        )
        if serve_config is not None:
            options = options.with_serve_config(serve_config)
        make = functools.partial(build_service, options)
    else:
        if parallel is not None or split_by_load:
            raise ValueError(
                "parallel, split_by_load: for a named model; a factory returns its own"
                " ParallelRunner"
            )
        store = None if jobs_db is None else postgres_store(jobs_db)
        videos = VideoConfig(
            jobs_dir=folder, store=store, checkpoint_every_s=checkpoint_every_s, lease_s=lease
        )
        http = serve_config if serve_config is not None else warming
        make = functools.partial(_runner_service, model, config, http, keys, videos)
    return application(
        make,
        shutdown_grace=config.shutdown_grace,
        max_ongoing_requests=(
            max_ongoing_requests
            if max_ongoing_requests is not None
            else config.max_batch_size + config.max_waiting
        ),
        num_replicas=num_replicas,
        max_queued_requests=max_queued_requests,
        ray_actor_options=ray_actor_options,
        autoscaling_config=autoscaling_config,
        name=name,
        shares_jobs=folder is not None,
    )
