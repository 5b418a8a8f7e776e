"""``POST /v1/images/generations``: one HTTP request, one engine request, one scope.

The endpoint is a plain ASGI app, so every step is explicit:

1. refuse at once while draining (503);
2. read the body, refusing it (413) from ``Content-Length`` or as soon as the bytes
   read pass ``max_body_bytes``, before any parsing;
3. parse and check it (400), then ``Engine.submit`` it (400, 429, 503);
4. inside ``async with handle``, run the answer (JSON, or server-sent events) in a
   task group next to a task that reads the ASGI receive channel: when it sees
   ``http.disconnect`` it aborts the request (reason ``client_disconnected``) and
   cancels the group. Leaving the handle's block then waits until the worker let go
   of the request (one step at most), so the next request runs at full speed.

With ``response_format: "url"`` (L97) the encoded images are written to the output
store (``_output_urls``, in a worker thread) and the answer, or each stream's
``completed`` event, carries their signed URLs instead of their base64.

A request with ``return_trajectory`` (L100) gets its trajectory as base64 text of
its safetensors bytes (``Trajectory.to_safetensors``; ``Trajectory.from_safetensors``
reads it): every image's in the answer's ``omni_trio.trajectory``, or streamed, each
image's own rows in its ``completed`` event's ``omni_trio.trajectory``.

A request the engine answered from its result cache (L95, L96) is complete when
``submit`` returns: its answer says so in the header ``x-omni-trio-result-cache: hit``
(``RESULT_CACHE_HEADER``) and in its ``omni_trio.result_cache_hit``; streamed, it sends
no progress or partial image (no step ran), only its ``completed`` events.

Why the receive channel and not ``Request.is_disconnected()``: the latter only
polls, and only when called; a request waiting for its result never calls it.
Why not rely on ``send`` failing: Uvicorn drops writes to a closed connection
silently, and a non-streaming request writes nothing until its image is ready.

The plumbing (the body within its limit, JSON and server-sent events, the watched
``Client``) is ``_asgi``'s; the body's checks are ``_schema``'s.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from .._errors import OmniTrioError
from ._asgi import (
    Client,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_error,
    send_json,
    sse_event,
    trace_headers,
)
from ._encode import b64, encode_images, encode_trajectory
from ._errors import ApiError, api_error_from, invalid
from ._keys import caller_tenant, tenant_request
from ._output_store import OutputStoreError
from ._output_urls import OutputUrls, storage_failed
from ._schema import DEADLINE_HEADER, ImageJob, parse_generation_body
from ._tracing import Tracing

if TYPE_CHECKING:
    from .._engine import Engine
    from .._handle import RequestHandle
    from .._stepcache import PromptCacheMetrics
    from ._config import ServeConfig
    from ._metrics import ServeMetrics

__all__ = ["RESULT_CACHE_HEADER", "ImagesEndpoint", "JobParser"]

#: The header of an answer that came from the engine's result cache (L96): ``hit``.
RESULT_CACHE_HEADER = "x-omni-trio-result-cache"

#: OpenAI's completed-event ``usage``: tokens do not apply to a diffusion model.
_NO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


#: Turns a request's scope and whole body into a job, or raises ``ApiError``.
JobParser = Callable[[Scope, bytes], Awaitable[ImageJob]]


class ImagesEndpoint:
    """The ASGI app of ``POST /v1/images/generations`` (and, given its parser, of edits).

    Args:
        config: the HTTP layer's configuration (limits, defaults, ``Retry-After``).
        metrics: where each request's outcome and timings are counted.
        admitting_engine: returns the engine if it admits requests now, else
            raises ``ApiError`` (503 while starting, draining or dead).
        parse: how a body becomes a job (default: a generation's JSON body).
        max_body_bytes: the body limit (default: ``config.max_body_bytes``).
        outputs: the output store that ``response_format: "url"`` writes to (L97);
            ``None`` when the server has none (the body's check refuses ``url``).
        tracing: the server's tracer (L99); off by default.
    """

    def __init__(
        self,
        *,
        config: ServeConfig,
        metrics: ServeMetrics,
        admitting_engine: Callable[[], Engine],
        parse: JobParser | None = None,
        max_body_bytes: int | None = None,
        outputs: OutputUrls | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._config = config
        self._tracing = tracing if tracing is not None else Tracing()
        self._outputs = outputs
        self._metrics = metrics
        self._admitting_engine = admitting_engine
        self._parse = parse if parse is not None else self._parse_generation
        self._max_body_bytes = config.max_body_bytes if max_body_bytes is None else max_body_bytes

    async def _parse_generation(self, scope: Scope, body: bytes) -> ImageJob:
        content_type = header(scope, "content-type") or ""
        if content_type.lower().startswith("multipart/form-data"):
            # A form (an SDK's edit call, or curl -F) is no JSON to report "not valid" in.
            raise invalid(
                "the body is multipart/form-data: this route takes JSON, send it as"
                " application/json (an image to edit goes to POST /v1/images/edits)",
                None,
                "invalid_content_type",
            )
        return parse_generation_body(
            body, self._config, deadline_header=header(scope, DEADLINE_HEADER)
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer one generation request (see the module docstring), traced where the
        server traces (L99: the route's span, the request's under it).

        Cancellation:
            Cancelling the server's task aborts the request; the call returns once
            the engine released it.
        """
        with self._tracing.route("POST", str(scope.get("path", "")), trace_headers(scope)) as span:
            await self._answer(scope, receive, send, span)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, span: Any) -> None:
        config = self._config
        metrics = self._metrics
        try:
            engine = self._admitting_engine()
            body = await read_body(scope, receive, self._max_body_bytes)
            if body is None:
                metrics.count("disconnected", caller_tenant(scope))
                return
            job = await self._parse(scope, body)
            request = tenant_request(job.request, scope)
            handle = engine.submit(request, request_id=f"img-{uuid.uuid4().hex}")
        except OmniTrioError as exc:
            error = api_error_from(exc, retry_after_s=config.retry_after_s)
            metrics.count(error.outcome, caller_tenant(scope))
            Tracing.status(span, error.status)
            await send_error(send, error)
            return
        except ApiError as error:
            metrics.count(error.outcome, caller_tenant(scope))
            Tracing.status(span, error.status)
            await send_error(send, error)
            return
        client = Client(receive, send, handle)
        try:
            async with handle:
                if job.stream:
                    await client.stream(
                        handle.request_id,
                        lambda: self._send_events(handle, job, client, scope),
                        _cache_headers(handle),
                    )
                else:
                    await self._answer_json(handle, job, client, scope)
        finally:
            outcome = self._metrics.account(handle, gone=client.is_gone)
            self._tracing.request(
                span,
                request=request,
                request_id=handle.request_id,
                model=config.model_name,
                outcome=outcome,
                metrics=handle.metrics,
                answered_ns=time.time_ns(),
            )

    def _failure(self, exc: OmniTrioError | ApiError, request_id: str) -> ApiError:
        """The error that answers an admitted request whose result or output failed."""
        if isinstance(exc, ApiError):
            return exc
        return api_error_from(exc, retry_after_s=self._config.retry_after_s, request_id=request_id)

    async def _images(
        self, images: list[bytes], job: ImageJob, request_id: str, scope: Scope
    ) -> list[dict[str, str]]:
        """Each image as the answer carries it: base64, or (L97) kept in the output store
        and given as its signed URL.

        Raises:
            ApiError: 500 ``storage_error``: the store could not keep one (logged).
        """
        if job.response_format != "url":
            return [{"b64_json": b64(image)} for image in images]
        outputs = self._outputs
        assert outputs is not None, "the body's check refuses url without a store"
        expires = outputs.expiry()
        extension = job.output_format
        files = [(f"{index}.{extension}", image) for index, image in enumerate(images)]
        try:
            keys = await outputs.keep(f"images/{request_id}", files, expires=expires)
        except OutputStoreError as exc:
            raise storage_failed(exc, f"request {request_id}") from None
        return [{"url": outputs.url(scope, key, expires)} for key in keys]

    async def _answer_json(
        self, handle: RequestHandle, job: ImageJob, client: Client, scope: Scope
    ) -> None:
        status = 200
        headers: Mapping[str, str] = {"X-Request-Id": handle.request_id, **_cache_headers(handle)}
        body: object = None
        with client.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.watch)
                try:
                    output = await handle.result()
                    images = await encode_images(
                        output.images, job.output_format, job.output_compression
                    )
                    data = await self._images(images, job, handle.request_id, scope)
                    extra: dict[str, str] = {}
                    if output.trajectory is not None:
                        extra["trajectory"] = await encode_trajectory(output.trajectory)
                except (OmniTrioError, ApiError) as exc:
                    error = self._failure(exc, handle.request_id)
                    status, body = error.status, error.body()
                    headers = {**headers, **error.headers}
                else:
                    metrics = output.metrics
                    body = {
                        "created": int(time.time()),
                        "data": data,
                        "background": "opaque",
                        "output_format": job.output_format,
                        "quality": job.quality,
                        "size": job.size,
                        "omni_trio": {
                            "request_id": handle.request_id,
                            "steps": job.request.denoise_steps,
                            "seed": job.request.seed,
                            "queue_wait_s": metrics.queue_wait_s,
                            "exec_s": metrics.exec_s,
                            "total_s": metrics.total_s,
                            "result_cache_hit": metrics.result_cache_hit,
                            "prompt_cache": _prompt_cache_figures(metrics.prompt_cache),
                            **extra,
                        },
                    }
                tg.cancel_scope.cancel()
        if not client.is_gone:
            await send_json(client.send, status, body, headers)

    async def _send_events(
        self, handle: RequestHandle, job: ImageJob, client: Client, scope: Scope
    ) -> None:
        common = {
            "background": "opaque",
            "output_format": job.output_format,
            "quality": job.quality,
            "size": job.size,
        }
        partial_index = 0
        async for event in handle:
            now = int(time.time())
            await client.chunk(
                sse_event(
                    f"{job.events}.progress",
                    {
                        "type": f"{job.events}.progress",
                        "step": event.step,
                        "total": event.total,
                        "created_at": now,
                    },
                )
            )
            if event.preview is None:
                continue
            previews = await encode_images(event.preview, job.output_format, job.output_compression)
            # A preview is at the latents' size (64x64 makes 8x8), not the image's.
            height, width = event.preview.shape[-2:]
            for index, data in enumerate(previews):
                partial = {
                    "type": f"{job.events}.partial_image",
                    "b64_json": b64(data),
                    "partial_image_index": partial_index,
                    "image_index": index,
                    "step": event.step,
                    "total": event.total,
                    "created_at": now,
                    **common,
                    "size": f"{width}x{height}",
                }
                await client.chunk(sse_event(f"{job.events}.partial_image", partial))
            partial_index += 1
        try:
            output = await handle.result()
            images = await encode_images(output.images, job.output_format, job.output_compression)
            answers = await self._images(images, job, handle.request_id, scope)
            trajectories: list[dict[str, object]] = [{} for _ in answers]
            if output.trajectory is not None:
                for index, extra in enumerate(trajectories):
                    trajectory = await encode_trajectory(output.trajectory, index)
                    extra["omni_trio"] = {"trajectory": trajectory}
        except (OmniTrioError, ApiError) as exc:
            error = self._failure(exc, handle.request_id)
            await client.chunk(sse_event("error", {"type": "error", **error.body()}))
        else:
            now = int(time.time())
            for index, (image, extra) in enumerate(zip(answers, trajectories, strict=True)):
                completed = {
                    "type": f"{job.events}.completed",
                    **image,
                    "image_index": index,
                    "created_at": now,
                    "usage": _NO_USAGE,
                    **common,
                    **extra,
                }
                await client.chunk(sse_event(f"{job.events}.completed", completed))
        await client.end()


def _prompt_cache_figures(figures: PromptCacheMetrics | None) -> dict[str, object] | None:
    """A request's prompt-cache figures as the answer's ``omni_trio.prompt_cache`` (L94)."""
    return None if figures is None else dataclasses.asdict(figures)


def _cache_headers(handle: RequestHandle) -> dict[str, str]:
    """``RESULT_CACHE_HEADER: hit`` for a request answered from the result cache (L96)."""
    metrics = handle.metrics
    return {RESULT_CACHE_HEADER: "hit"} if metrics is not None and metrics.result_cache_hit else {}
