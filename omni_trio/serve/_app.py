"""Service: an engine behind an OpenAI-style HTTP API (images, edits, videos), on Starlette.

The engine's lifetime is the app's lifespan: ``open_engine`` runs at startup and
its shutdown sequence at shutdown, so the server (Hypercorn on trio, Uvicorn on
asyncio, or any ASGI server) owns it the way it owns its connections.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .._config import EngineConfig
from .._engine import Engine
from .._errors import EngineClosedError, OmniTrioError
from .._open import open_engine
from .._outputs import EngineStatistics, GenerationOutput
from .._request import GenerationRequest
from .._runner import Runner, RunnerCapabilities, runner_sequence
from .._runner_adapters import RunnerAdapters
from ._adapters import AdaptersApi, adapter_card
from ._asgi import Asgi, Scope, error_response
from ._config import Admission, ServeConfig
from ._edits import parse_edit_form
from ._errors import ApiError, api_error_from, unexpected_error
from ._files import FilesEndpoint
from ._images import ImagesEndpoint
from ._keys import ApiKeys, KeyGate
from ._metrics import ServeMetrics
from ._output_urls import FILES_PATH, OutputUrls
from ._schema import ImageJob
from ._tracing import Tracing
from ._upload import UploadLimits
from ._videos import VideosApi
from ._warmup import warm_up, warm_up_requests
from ._weights import WeightsApi
from .jobs import VideoConfig, VideoJobs

__all__ = ["NOT_STARTED", "Service", "create_app"]

_log = logging.getLogger("omni_trio.serve")

NOT_STARTED = (
    "the service's lifespan has not run: an app that mounts it must enter"
    " service.lifespan() in its own lifespan"
)
"""The 503 message of a mounted service whose lifespan never ran."""


class Service:
    """Serve one runner, or one per device, over HTTP: routes, lifespan, health, metrics, drain.

    ``service.app`` is the ASGI app. Its lifespan opens the engine (so it can run
    once: the engine closes the runner on shutdown). Routes:

    - ``POST /v1/images/generations``: OpenAI images API (JSON or server-sent events);
    - ``POST /v1/images/edits``: OpenAI's image edits (a multipart form with an
      image and an optional mask): image-to-image and inpainting, answered as
      generations are (L76);
    - ``/v1/videos``: OpenAI's video jobs, for a video model (L73): ``POST`` makes
      a job and answers at once, ``GET`` lists them, ``GET /v1/videos/{id}`` reads
      one, ``DELETE`` aborts and drops it, ``.../content`` is its MP4 and
      ``.../events`` its progress as server-sent events;
    - ``GET /v1/files/{key}``, with an output store (``ServeConfig.outputs``, L97):
      an output kept as a signed URL (``response_format: "url"``), which needs
      no API key: its signature is its credential;
    - ``GET /v1/models`` and ``GET /v1/models/{id}``: the served model, and the
      adapters it has loaded (L88);
    - ``/v1/adapters``: ``GET`` lists the adapters; ``POST`` loads one from the
      adapter folder and ``DELETE /v1/adapters/{name}`` unloads one, as admin
      actions (``ServeConfig.allow_adapter_admin``; see ``_adapters``);
    - ``/v1/weights``, ``/v1/sleep``, ``/v1/wake``: the weights served, updated in place
      from a file of the adapter folder, put to sleep and woken, as admin actions
      (L102, L103; see ``_weights``);
    - ``GET /health``: 200 when ready (``"degraded"`` while some workers have died
      and the others serve, L43), 503 while starting, draining or dead;
    - ``GET /metrics``: Prometheus text, from this service's own registry.

    Args:
        runner: the model runner (see ``omni_trio.runners``), or a sequence of
            them, one per device (see ``open_engine``).
        engine_config: the engine's configuration: batch size, queue bound,
            ``shutdown_grace``, and the limits on steps, sizes and ``n``.
        config: the HTTP layer's configuration.
        upload_limits: how large an edit's upload may be (bytes, pixels).
        video_config: a video model's jobs: fps, the bound, the time-to-live.
        keys: the API keys it accepts (L55, L56): with any, every route but
            ``/health`` (and ``/metrics`` unless ``keys.metrics_auth``) needs
            ``Authorization: Bearer <key>``, requests run as the key's tenant,
            and the tenants' weights and waiting bounds join ``engine_config``'s
            (``tenant_weights``, ``tenant_max_waiting``). ``None``: an open
            server, as it says in its log at start.
        tracing: the server's tracer (``Tracing``, L99): a span per route and per
            request; ``None``: off (``Tracing.from_environment`` reads ``OTEL_*``).
    """

    def __init__(
        self,
        runner: Runner[Any] | Sequence[Runner[Any]],
        *,
        engine_config: EngineConfig | None = None,
        config: ServeConfig | None = None,
        upload_limits: UploadLimits | None = None,
        video_config: VideoConfig | None = None,
        keys: ApiKeys | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.config = config if config is not None else ServeConfig()
        self.upload_limits = upload_limits if upload_limits is not None else UploadLimits()
        engine_config = engine_config if engine_config is not None else EngineConfig()
        self.keys = keys if keys else None
        if self.keys is not None:
            engine_config = dataclasses.replace(
                engine_config,
                tenant_weights={**engine_config.tenant_weights, **self.keys.weights()},
                tenant_max_waiting={
                    **engine_config.tenant_max_waiting,
                    **self.keys.max_waiting(),
                },
            )
        self.engine_config = engine_config
        self._runner = runner
        self._engine: Engine | None = None
        self._draining = False
        self._started = False
        self._created = int(time.time())
        self.metrics = ServeMetrics(self._statistics, lambda: self.is_draining)
        if self.keys is not None:
            self.metrics.set_tenants(self.keys.tenants)
        first = runner if not isinstance(runner, Sequence) else (runner[0] if runner else None)
        capabilities = getattr(first, "capabilities", None)
        if not isinstance(capabilities, RunnerCapabilities):
            capabilities = None  # the engine refuses such a runner as it opens
        #: The runner's frame rule (L70): ``None`` for an image model.
        self.frames: tuple[int, int] | None = getattr(capabilities, "frames", None)
        self._takes_adapters = bool(getattr(capabilities, "max_adapters", 0))
        # What the engine admits, checked where a body costs work to become a request.
        self._admission = Admission(
            engine=self.engine_config,
            capabilities=capabilities,
            adapters=_admission_adapters(runner, capabilities),
            step_time=self._check_step_time,
        )
        self.videos = VideoJobs(
            video_config if video_config is not None else VideoConfig(),
            self.metrics,
            retry_after_s=self.config.retry_after_s,
            checkpoints=bool(getattr(capabilities, "checkpoints", False)),
        )
        self.metrics.add_video_jobs(self.videos.counts, self.videos.held_bytes)
        if engine_config.result_cache is not None:
            self.metrics.add_result_cache()
        #: The server's tracer (L99): its routes' spans and its requests'; off unless given.
        self.tracing = tracing if tracing is not None else Tracing()
        self.videos.tracing = self.tracing
        #: The output store behind ``response_format: "url"`` (L97), if configured.
        self.outputs = OutputUrls(self.config.outputs) if self.config.outputs else None
        if self.outputs is not None:
            self.videos.on_delete = self._forget_video
        groups = _groups(runner)
        if groups:
            self.metrics.add_groups(groups)
        self.metrics.add_prompt_caches(runner_sequence(runner))
        videos = VideosApi(
            config=self.config,
            metrics=self.metrics,
            jobs=self.videos,
            admitting_engine=self._engine_for_videos,
            rule=self.frames,
            admission=self._admission,
            upload_limits=self.upload_limits,
            outputs=self.outputs,
        )
        adapters = AdaptersApi(config=self.config, engine=self.engine_for_requests)
        weights = WeightsApi(config=self.config, engine=self.engine_for_requests)
        self.app = Starlette(
            routes=[
                Route(
                    "/v1/images/generations",
                    ImagesEndpoint(
                        config=self.config,
                        metrics=self.metrics,
                        admitting_engine=self._engine_for_images,
                        outputs=self.outputs,
                        tracing=self.tracing,
                    ),
                    methods=["POST"],
                ),
                Route(
                    "/v1/images/edits",
                    ImagesEndpoint(
                        config=self.config,
                        metrics=self.metrics,
                        admitting_engine=self._engine_for_images,
                        parse=self._parse_edit,
                        max_body_bytes=self.upload_limits.max_bytes,
                        outputs=self.outputs,
                        tracing=self.tracing,
                    ),
                    methods=["POST"],
                ),
                Route("/v1/videos", Asgi(videos.create), methods=["POST"]),
                Route("/v1/videos", videos.list, methods=["GET"]),
                Route("/v1/videos/{video_id}", videos.job, methods=["GET", "DELETE"]),
                Route("/v1/videos/{video_id}/content", videos.content, methods=["GET"]),
                Route("/v1/videos/{video_id}/events", Asgi(videos.events), methods=["GET"]),
                Route("/v1/adapters", adapters.list, methods=["GET"]),
                Route("/v1/adapters", adapters.load, methods=["POST"]),
                Route("/v1/adapters/{name}", adapters.unload, methods=["DELETE"]),
                Route("/v1/weights", weights.show, methods=["GET"]),
                Route("/v1/weights", weights.update, methods=["POST"]),
                Route("/v1/sleep", weights.sleep, methods=["POST"]),
                Route("/v1/wake", weights.wake, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                *self._files_routes(),
            ],
            lifespan=self._lifespan,
            exception_handlers={HTTPException: self._http_error, Exception: self._unexpected},
            # The key check comes before routing: an unknown path needs a key too.
            middleware=[
                Middleware(
                    KeyGate,
                    keys=self.keys,
                    refused=self._refused,
                    open_prefixes=(FILES_PATH,) if self.outputs is not None else (),
                )
            ],
        )
        self.app.state.service = self

    def _files_routes(self) -> list[Route]:
        """``GET /v1/files/{key}`` where there is an output store (L97)."""
        if self.outputs is None:
            return []
        endpoint = FilesEndpoint(self.outputs)
        return [Route(FILES_PATH + "{key:path}", endpoint, methods=["GET"])]

    async def _forget_video(self, job_id: str) -> None:
        """A video job was deleted: its URL outputs go with it (L97)."""
        assert self.outputs is not None
        await self.outputs.forget(f"videos/{job_id}")

    # -- state ---------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        """The engine, once the lifespan opened it."""
        return self._engine

    @property
    def is_draining(self) -> bool:
        """Whether shutdown began (``drain()``, a signal, or the lifespan's end)."""
        engine = self._engine
        return self._draining or (engine is not None and engine.statistics().is_closing)

    @property
    def is_ready(self) -> bool:
        """Whether new generation requests are admitted."""
        return self._engine is not None and not self.is_draining

    def _refused(self, error: ApiError, tenant: str | None) -> None:
        self.metrics.count(error.outcome, tenant)

    def _check_step_time(self, request: GenerationRequest) -> None:
        """``max_step_s`` by the open engine's measured steps (L4); none before it opens."""
        if self._engine is not None:
            self._engine.check_step_time(request)

    def _statistics(self) -> EngineStatistics | None:
        return self._engine.statistics() if self._engine is not None else None

    async def generate(
        self, request: GenerationRequest, *, request_id: str | None = None
    ) -> GenerationOutput:
        """Generate ``request`` on the open engine, counted in ``/metrics`` as the routes
        count theirs: its outcome, its timings, its tenant. For callers beside the HTTP
        app in the same process (Ray Serve's handle, ``ImageDeployment.generate``).

        Raises:
            EngineClosedError: the service is not serving (starting or draining).
            RequestError: as ``Engine.generate``.

        Cancellation:
            As ``Engine.generate``: the request is aborted, and the call returns once
            the engine released it (L11); it is counted as ``aborted``.
        """
        engine = self._engine
        if engine is None or not self.is_ready:
            raise EngineClosedError("the service is not serving")
        try:
            handle = engine.submit(request, request_id=request_id)
        except OmniTrioError as exc:
            self.metrics.count(api_error_from(exc).outcome, request.tenant)
            raise
        try:
            async with handle:
                return await handle.result()
        finally:
            self.metrics.account(handle)

    def engine_for_requests(self) -> Engine:
        """The engine, if it admits requests now.

        Raises:
            ApiError: 503 while starting, draining or dead.
        """
        engine = self._engine
        if engine is None or self.is_draining:
            if not self._started:
                message, code = NOT_STARTED, "not_started"
            elif engine is None:
                message, code = "the server is starting", "starting"
            else:
                message, code = "the server is shutting down", "shutting_down"
            raise ApiError(
                503,
                message,
                type="server_error",
                code=code,
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        return engine

    def _engine_for_images(self) -> Engine:
        if self.frames is not None:
            raise ApiError(
                400,
                f"this server serves a video model ({self.config.model_name}): use POST /v1/videos",
                code="unsupported_model",
            )
        return self.engine_for_requests()

    def _engine_for_videos(self) -> Engine:
        if self.frames is None:
            raise ApiError(
                400,
                f"this server serves an image model ({self.config.model_name}):"
                " use POST /v1/images/generations",
                code="unsupported_model",
            )
        return self.engine_for_requests()

    async def drain(self) -> None:
        """Shut the engine down while the server still answers.

        ``/health`` turns 503 and new requests get 503 at once; waiting requests
        end (503), running ones get ``shutdown_grace`` seconds to finish, the rest
        stop at their next step boundary (503, or an ``error`` event when
        streaming). Returns when the engine's threads are joined. Idempotent; a
        server's own shutdown (the lifespan's end) does the same if nothing called
        this first.

        Cancellation:
            Ends the grace period early; running requests are cut at the next step
            and the engine is closed before the cancellation propagates.
        """
        first = not self._draining
        self._draining = True
        engine = self._engine
        if engine is None:
            return
        if first and not engine.statistics().is_closing:
            stats = engine.statistics()
            _log.info(
                "draining: %d running, %d waiting; running requests get %g s to finish",
                stats.running,
                stats.waiting,
                self.engine_config.shutdown_grace,
            )
        await engine.aclose()
        if first:
            stats = engine.statistics()
            _log.info(
                "drained: %d completed, %d aborted, %d failed in all",
                stats.completed,
                stats.aborted,
                stats.failed,
            )

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[Service]:
        """Open the engine for the block; drain it when the block is left.

        ``service.app`` runs this as its own lifespan. A host app that mounts
        ``service.app`` (Starlette and FastAPI run no lifespan of a mounted app)
        enters it in its own lifespan instead (see docs/serving.md). Until it is
        entered, generation requests and ``/health`` answer 503 ``not_started``.

        Yields:
            This service.

        The video jobs' task group (L73) lives inside it: leaving the block drains
        the engine (every job's request ends), then waits for the jobs' tasks
        (each within one MP4 encode), so no job's task outlives the block.

        Raises:
            RuntimeError: the lifespan ran before (the engine closes the runner).
            OutputStoreError: the output store (``ServeConfig.outputs``) cannot be
                used: its folder cannot be written, its bucket reached (L97).
            EngineDeadError: on exit, if the worker died (L23).

        Cancellation:
            Leaving the block runs the drain shielded, as ``open_engine`` does.
        """
        if self._started:
            raise RuntimeError("a Service runs once: its engine closes the runner")
        self._started = True
        if self.keys is None:
            _log.info("no API keys: every route is open to anyone who can reach this server")
        else:
            _log.info(
                "%d API keys for %d tenants; /metrics %s",
                len(self.keys.keys),
                len(self.keys.tenants),
                "needs a key" if self.keys.metrics_auth else "is open",
            )
        try:
            async with (
                self._outputs_open(),
                open_engine(self._runner, self.engine_config) as engine,
            ):
                self._engine = engine
                await self._warm_up(engine)
                left: BaseException | None = None
                async with anyio.create_task_group() as jobs:
                    # A video model's jobs, from the durable store if there is one (L77).
                    await jobs.start(self.videos.serve, engine if self.frames is not None else None)
                    if self.outputs is not None:
                        # The output store's sweeper (L97), and its close at the end.
                        await jobs.start(self.outputs.serve)
                    try:
                        yield self
                    except BaseException as exc:
                        # Re-raised below, outside the task group, which would wrap it
                        # in an exception group.
                        left = exc
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self.drain()
                        # Every job's request is terminal now: its task ends by itself.
                        self.videos.close()
                        if self.outputs is not None:
                            self.outputs.close()  # the sweeper; the store closes last
                if left is not None:
                    raise left
        finally:
            with anyio.CancelScope(shield=True):
                # The spans still queued go out (L99); the tracer is its owner's to stop.
                await anyio.to_thread.run_sync(self.tracing.flush)

    async def _warm_up(self, engine: Engine) -> None:
        """The warm-up requests (L4), before the server answers; a compiled runner's
        declared shapes at one and two rows, then its graphs sealed (L90)."""
        capabilities = self._admission.capabilities
        if not self.config.warm_up or capabilities is None:
            return
        compiled: list[Any] = [each for each in runner_sequence(self._runner) if _compiled(each)]

        def seal() -> None:
            for runner in compiled:
                runner.seal_compile()

        await warm_up(
            engine,
            warm_up_requests(capabilities, self.config),
            together=min(2, self.engine_config.max_batch_size) if compiled else 1,
            seal=seal if compiled else None,
        )

    @asynccontextmanager
    async def _outputs_open(self) -> AsyncIterator[None]:
        """The output store (L97) checked before the engine opens, closed after it."""
        outputs = self.outputs
        if outputs is None:
            yield
            return
        await outputs.open()
        try:
            yield
        finally:
            await outputs.aclose()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with self.lifespan():
            yield

    # -- routes --------------------------------------------------------------

    async def _parse_edit(self, scope: Scope, body: bytes) -> ImageJob:
        return await parse_edit_form(scope, body, self.config, self.upload_limits, self._admission)

    def _model_card(self) -> dict[str, object]:
        config = self.config
        card: dict[str, object] = {
            "id": config.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "omni_trio",
            # What a request that leaves them out gets.
            "default_size": f"{config.default_width}x{config.default_height}",
            "default_steps": config.default_steps,
            "default_guidance_scale": config.default_guidance_scale,
        }
        if self.frames is not None:
            # A video model (L73): what a job that gives no length gets.
            videos = self.videos.config
            period, remainder = self.frames
            card["fps"] = videos.fps
            card["default_seconds"] = f"{videos.default_seconds:g}"
            card["frames"] = f"{period}k + {remainder}"
        engine = self._engine
        if engine is not None and self._takes_adapters:
            # L88: the adapters a request may name.
            card["adapters"] = [adapter_card(info) for info in engine.adapters()]
        return card

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.config.model_name:
            error = ApiError(
                404, f"the model {model_id!r} does not exist", param="model", code="model_not_found"
            )
            return error_response(error)
        return JSONResponse(self._model_card())

    async def _health(self, request: Request) -> Response:
        engine = self._engine
        if engine is not None and engine.statistics().is_dead:
            status = "dead"
        elif engine is None:
            status = "starting" if self._started else "not_started"
        elif self.is_draining:
            status = "draining"
        else:
            stats = engine.statistics()
            body: dict[str, Any] = {"status": "ok", "model": self.config.model_name}
            if stats.workers_alive < len(stats.workers):
                body.update(
                    status="degraded", workers_alive=stats.workers_alive, workers=len(stats.workers)
                )
            return JSONResponse(body)
        headers = {"Retry-After": str(self.config.retry_after_s)}
        body = {"status": status}
        if status == "not_started":
            body["message"] = NOT_STARTED
        return JSONResponse(body, status_code=503, headers=headers)

    async def _metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        return error_response(unexpected_error())

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        error = ApiError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            code=code,
            headers=exc.headers,
        )
        return error_response(error)


def _compiled(runner: object) -> bool:
    """Whether ``runner`` runs compiled blocks, to seal after the warm-up (L90)."""
    return bool(getattr(runner, "compiled_blocks", 0)) and callable(
        getattr(runner, "seal_compile", None)
    )


def create_app(
    runner: Runner[Any] | Sequence[Runner[Any]],
    *,
    engine_config: EngineConfig | None = None,
    config: ServeConfig | None = None,
) -> Starlette:
    """Build the ASGI app that serves ``runner``: images, edits and videos (see ``Service``).

    The app's ``state.service`` is its ``Service``.
    """
    return Service(runner, engine_config=engine_config, config=config).app


def _groups(
    runner: Runner[Any] | Sequence[Runner[Any]],
) -> dict[int, tuple[int, Callable[[], Mapping[str, int]]]]:
    """Each parallel worker's index, ranks and call counts, for ``/metrics``."""
    parallel = sys.modules.get("omni_trio.parallel")
    if parallel is None:  # not imported: no runner is a ParallelRunner
        return {}
    return {
        index: (each.world_size, each.calls)
        for index, each in enumerate(runner_sequence(runner))
        if isinstance(each, parallel.ParallelRunner)
    }


def _admission_adapters(
    runner: Runner[Any] | Sequence[Runner[Any]], capabilities: RunnerCapabilities | None
) -> RunnerAdapters | None:
    """The runners' adapters for ``Admission``: the names the engine admits, read from the
    same runners (any thread; never waits for a step); ``None`` when they take none.

    Runners that declare adapters without the calls get ``None``: the engine refuses
    them as it opens (L85), the place to say so.
    """
    if capabilities is None or not capabilities.max_adapters:
        return None
    try:
        return RunnerAdapters(runner_sequence(runner), capabilities)
    except TypeError:
        return None
