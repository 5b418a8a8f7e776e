"""The ``/v1/videos`` routes (L73): OpenAI's video jobs API over ``VideoJobs``.

- ``POST /v1/videos``: check the body (a form, as the OpenAI SDK sends, or JSON),
  submit the request, start the job's task, answer the job at once (``queued``);
- ``GET /v1/videos``: the jobs, newest first, OpenAI's list shape and cursor
  (``limit``, ``after``, ``order``);
- ``GET /v1/videos/{id}``: the job; ``DELETE``: abort and drop it, at once;
- ``GET /v1/videos/{id}/content``: the MP4 (``video/mp4``) once completed; with
  ``?response_format=url`` (L97), JSON instead: the MP4 kept in the output store
  (once; a later ask reuses it) and its signed URL, expiring no later than the job.
  A query parameter, not a field of the job, because ``client.videos.download_content``
  passes it (``extra_query``) and hands back the JSON (``.json()``), while the job stays
  OpenAI's ``Video`` and a list or a poll costs no store write or listing;
- ``GET /v1/videos/{id}/events``: server-sent events: the job after every change
  (``video.progress``), then ``video.completed`` or ``video.failed`` (or
  ``error`` if it is deleted meanwhile). A watcher that disconnects stops only
  its stream: the job goes on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .._errors import OmniTrioError
from ._asgi import (
    Client,
    Receive,
    Scope,
    Send,
    error_response,
    header,
    read_body,
    send_error,
    send_json,
    sse_event,
    trace_headers,
)
from ._errors import ApiError, api_error_from, invalid
from ._forms import read_form
from ._keys import caller, caller_tenant, check_running_jobs, tenant_request, viewer
from ._output_store import OutputStoreError
from ._output_urls import OutputUrls, storage_failed
from ._schema import DEADLINE_HEADER, no_output_store, shown
from ._tracing import Tracing
from ._upload import UploadLimits
from ._video_body import video_body, video_spec, with_reference

if TYPE_CHECKING:
    from .._engine import Engine
    from ._config import Admission, ServeConfig
    from ._metrics import ServeMetrics
    from .jobs import VideoJob, VideoJobs

__all__ = ["VideosApi"]

#: The most jobs one page lists, and how many when ``limit`` is not given.
MAX_LIMIT = 100
DEFAULT_LIMIT = 20


class VideosApi:
    """The ``/v1/videos`` routes of one service.

    Args:
        config: the HTTP layer's configuration.
        metrics: where refusals are counted (the jobs count their own outcomes).
        jobs: the store.
        admitting_engine: returns the engine if it admits video jobs now, else
            raises ``ApiError`` (400 for an image model, 503 while starting,
            draining or dead).
        rule: the runner's frame rule, ``None`` for an image model.
        admission: the engine's limits, checked before a job takes a place.
        upload_limits: how large an ``input_reference`` may be (its pixels; the
            body's bytes are ``config.max_body_bytes``).
        outputs: the output store that a content URL is kept in (L97); ``None``:
            none (``?response_format=url`` is a 400 naming it).
    """

    def __init__(
        self,
        *,
        config: ServeConfig,
        metrics: ServeMetrics,
        jobs: VideoJobs,
        admitting_engine: Callable[[], Engine],
        rule: tuple[int, int] | None,
        admission: Admission,
        upload_limits: UploadLimits | None = None,
        outputs: OutputUrls | None = None,
    ) -> None:
        self._outputs = outputs
        self._admission = admission
        self._uploads = upload_limits if upload_limits is not None else UploadLimits()
        self._config = config
        self._metrics = metrics
        self._jobs = jobs
        self._admitting_engine = admitting_engine
        self._rule = rule

    # -- POST /v1/videos --------------------------------------------------------

    async def create(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer ``POST /v1/videos`` (an ASGI app).

        Cancellation:
            Safe: a job is started only once the answer is decided, and runs in
            the service's task group, not in this call.
        """
        tracing = self._jobs.tracing
        with tracing.route("POST", str(scope.get("path", "")), trace_headers(scope)) as span:
            try:
                job = await self._create(scope, receive, span)
            except OmniTrioError as exc:
                error = api_error_from(exc, retry_after_s=self._config.retry_after_s)
            except ApiError as exc:
                error = exc
            else:
                if job is not None:
                    await send_json(send, 200, job.body(), {"X-Request-Id": job.id})
                else:
                    self._metrics.count("disconnected", caller_tenant(scope))
                return
            self._metrics.count(error.outcome, caller_tenant(scope))
            Tracing.status(span, error.status)
            await send_error(send, error)

    async def _create(self, scope: Scope, receive: Receive, span: Any) -> VideoJob | None:
        engine = self._admitting_engine()
        assert self._rule is not None  # admitting_engine refused an image model
        limit = self._config.max_body_bytes
        body = await read_body(scope, receive, limit)
        if body is None:
            return None
        content_type = header(scope, "content-type") or ""
        form = None
        if content_type.lower().startswith("multipart/form-data"):
            form = await read_form(scope, body, dataclasses.replace(self._uploads, max_bytes=limit))
        video = self._jobs.config
        spec = video_spec(
            video_body(body, form),
            self._config,
            fps=video.fps,
            default_seconds=video.default_seconds,
            rule=self._rule,
            deadline_header=header(scope, DEADLINE_HEADER),
            admission=self._admission,
            limits=self._uploads,
        )
        key = caller(scope)
        if key is not None:
            await self._jobs.check_room()
            check_running_jobs(key, self._jobs.running_of(key.tenant), self._config.retry_after_s)
        if spec.reference is not None:
            # L69: admitted but for its image: decode it now, off the loop.
            spec = await anyio.to_thread.run_sync(with_reference, spec)
        spec = dataclasses.replace(spec, request=tenant_request(spec.request, scope))
        return await self._jobs.create(
            engine, spec, self._config.model_name, tenant=spec.request.tenant, trace=span
        )

    # -- the other routes -------------------------------------------------------

    async def list(self, request: Request) -> Response:
        """``GET /v1/videos``: a page of jobs, OpenAI's list shape."""
        params = request.query_params
        try:
            limit = _limit(params.get("limit"))
            order = params.get("order", "desc")
            if order not in ("asc", "desc"):
                raise invalid(f"order: must be 'asc' or 'desc', got {shown(order)}", "order")
            jobs, more = await self._jobs.page(
                limit=limit, after=params.get("after"), order=order, tenant=viewer(request.scope)
            )
        except ApiError as error:
            return error_response(error)
        data = [job.body() for job in jobs]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": jobs[0].id if jobs else None,
                "last_id": jobs[-1].id if jobs else None,
                "has_more": more,
            }
        )

    async def job(self, request: Request) -> Response:
        """``GET`` the job, or ``DELETE`` it (abort its request, drop it, answer at once)."""
        job_id = request.path_params["video_id"]
        tenant = viewer(request.scope)
        try:
            if request.method == "DELETE":
                await self._jobs.delete(job_id, tenant=tenant)
                return JSONResponse({"id": job_id, "object": "video.deleted", "deleted": True})
            return JSONResponse((await self._jobs.find(job_id, tenant=tenant)).body())
        except ApiError as error:
            return error_response(error)

    async def content(self, request: Request) -> Response:
        """``GET /v1/videos/{id}/content``: the MP4 of a completed job, or its URL (L97)."""
        try:
            params = request.query_params
            variant = params.get("variant", "video")
            if variant != "video":
                raise invalid(
                    f"variant: only 'video' is served here, got {shown(variant)}",
                    "variant",
                    "unsupported_value",
                )
            as_url = params.get("response_format")
            if as_url not in (None, "url"):
                raise invalid(
                    f"response_format: must be 'url' (or absent: the MP4), got {shown(as_url)}",
                    "response_format",
                )
            if as_url is not None and self._outputs is None:
                raise no_output_store("response_format")
            job = await self._jobs.find(
                request.path_params["video_id"], tenant=viewer(request.scope)
            )
            if job.status != "completed":
                state = "failed" if job.is_finished else f"{job.status} ({job.progress}%)"
                raise invalid(
                    f"video {job.id} is {state}: its content is there once it completed",
                    "video_id",
                    "video_not_ready",
                )
            if self._outputs is not None and as_url is not None:
                return JSONResponse(await self._content_url(job, self._outputs, request))
            mp4 = await self._jobs.content(job)
            if mp4 is None:  # deleted or expired meanwhile
                raise _gone(job)
        except ApiError as error:
            return error_response(error)
        return Response(mp4, media_type="video/mp4")

    async def _content_url(
        self, job: VideoJob, outputs: OutputUrls, request: Request
    ) -> dict[str, object]:
        """The job's MP4 in the output store (kept once, until the job expires at the
        latest) and its signed URL.

        Raises:
            ApiError: 404 if the job went meanwhile; 500 ``storage_error``.
        """
        group = f"videos/{job.id}"
        expires = outputs.expiry(job.expires_at)
        try:
            found = await outputs.kept(group, expires=expires)
            if found is None:
                mp4 = await self._jobs.content(job)
                if mp4 is None:
                    raise _gone(job)
                keys = await outputs.keep(group, [("video.mp4", mp4)], expires=expires)
                del mp4
                found = keys[0], expires
        except OutputStoreError as exc:
            raise storage_failed(exc, f"video {job.id}") from None
        if job.removed:  # deleted while it was written: it goes with its job
            await outputs.forget(group)
            raise _gone(job)
        key, expires = found
        return {
            "id": job.id,
            "object": "video.content",
            "url": outputs.url(request.scope, key, expires),
            "expires_at": expires,
        }

    async def events(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/videos/{id}/events``: the job's changes as server-sent events (ASGI).

        Cancellation:
            Stops the stream; the job goes on.
        """
        tenant = viewer(scope)
        try:
            job = await self._jobs.find(scope["path_params"]["video_id"], tenant=tenant)
        except ApiError as error:
            await send_error(send, error)
            return
        client = Client(receive, send, None)
        await client.stream(job.id, lambda: self._send_events(job, client, tenant))

    async def _send_events(self, job: VideoJob, client: Client, tenant: str | None) -> None:
        sent: tuple[str, int] | None = None
        while True:
            if job.removed:
                error = _gone(job)
                await client.chunk(sse_event("error", {"type": "error", **error.body()}))
                break
            now = (job.status, job.progress)
            if now != sent:
                kind = job.status if job.is_finished else "progress"
                body = {"type": f"video.{kind}", "sent_at": int(time.time()), **job.body()}
                await client.chunk(sse_event(f"video.{kind}", body))
                sent = now
                continue  # the send may have let a change pass: look again first
            if job.is_finished:
                break
            # Nothing awaited since the check above: no change can slip past this wait.
            job = await self._jobs.next_change(job, tenant=tenant)
        await client.end()


def _gone(job: VideoJob) -> ApiError:
    return ApiError(404, f"video {job.id} was deleted or expired", code="video_not_found")


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    if not (text.isascii() and text.isdigit()) or len(text) > 6 or not 1 <= int(text) <= MAX_LIMIT:
        raise invalid(
            f"limit: must be an integer from 1 to {MAX_LIMIT}, got {shown(text)}", "limit"
        )
    return int(text)
