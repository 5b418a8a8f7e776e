"""The naive peer over HTTP: a pipeline's own ``__call__`` behind a lock, in a worker thread.

``python -m benchmarks.naive --port PORT [--kind sd]`` serves, under Uvicorn, the
same ``POST /v1/images/generations`` path as ``omni-trio serve`` for the same tiny
pipeline (``tiny_pipeline(kind, seed=0)``, with the defaults ``serve`` gives it),
a subset of its body (``prompt``, ``size``, ``num_inference_steps``,
``guidance_scale``, ``seed``, ``n``) and the same answer's shape (PNG images as
``b64_json``). It is the common way to serve a diffusers pipeline, the way
diffusers' own server example does: each request runs the whole call in a worker
thread, one at a time (a lock), and nothing stops a call whose client went away.

What it costs is counted: a side task polls ``request.is_disconnected()`` while
the request waits for the lock and runs; the call's ``callback_on_step_end`` counts
its denoise steps; the steps a call ran after its client was seen gone are
``steps_after_disconnect`` in ``GET /stats`` (JSON). ``/stats`` also sums the time
spent inside the pipeline's calls (``busy_s``, over ``calls``): the service time the
server really had under load, which on a shared machine can be far from its solo
latency. ``GET /health`` is 200 once the model is built.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from omni_trio import GenerationRequest
from omni_trio.serve._encode import b64, encode_images_sync

from .peers import call_kwargs

__all__ = ["NaiveServer", "NaiveStats", "main"]

PATH = "/v1/images/generations"

#: How often the side task asks whether the client is gone. Picked without
#: measurement: well under one tiny-model step, so a step is rarely miscounted.
POLL_S = 0.002


@dataclass(slots=True)
class NaiveStats:
    """What ``GET /stats`` answers.

    Args:
        requests: generation requests received (with a valid body).
        completed: answered with images to a client still connected.
        disconnected: requests whose client was seen gone before the answer.
        steps_run: denoise steps run, all requests.
        steps_after_disconnect: steps run for a request after its client was seen gone.
        in_flight: requests waiting for the lock or running now.
        calls: pipeline calls finished.
        busy_s: seconds spent inside those calls (holding the lock).
    """

    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    steps_run: int = 0
    steps_after_disconnect: int = 0
    in_flight: int = 0
    calls: int = 0
    busy_s: float = 0.0


@dataclass(slots=True)
class _Progress:
    """One request's steps (counted in the worker thread) and when its client left."""

    steps: int = 0
    gone_at_step: int | None = None


class NaiveServer:
    """The naive app (``.app``) for one pipeline.

    Args:
        pipeline: a diffusers text-to-image pipeline.
        size: (width, height) when a request gives none.
        steps: ``num_inference_steps`` when a request gives none.
        guidance_scale: when a request gives none.
    """

    def __init__(
        self, pipeline: Any, *, size: tuple[int, int], steps: int, guidance_scale: float
    ) -> None:
        self._pipeline = pipeline
        self._size = size
        self._steps = steps
        self._guidance = guidance_scale
        self._lock = threading.Lock()
        self.stats = NaiveStats()
        self.app = Starlette(
            routes=[
                Route(PATH, self._generate, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/stats", self._stats, methods=["GET"]),
            ]
        )

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def _stats(self, request: Request) -> JSONResponse:
        return JSONResponse(asdict(self.stats))

    def _request(self, body: Any) -> GenerationRequest:
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise ValueError("the body must be a JSON object with a prompt")
        width, height = self._size
        if body.get("size") not in (None, "auto"):
            w, _, h = str(body["size"]).partition("x")
            width, height = int(w), int(h)
        return GenerationRequest(
            prompt=body["prompt"],
            num_steps=int(body.get("num_inference_steps") or self._steps),
            width=width,
            height=height,
            guidance_scale=float(body.get("guidance_scale", self._guidance)),
            seed=body.get("seed"),
            num_images=int(body.get("n") or 1),
        )

    def _call(self, request: GenerationRequest, progress: _Progress) -> list[bytes]:
        """In a worker thread: wait for the lock, run the whole call, encode."""
        stats = self.stats

        def on_step_end(pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> Any:
            # Only the thread holding the lock counts: no race on the totals.
            progress.steps += 1
            stats.steps_run += 1
            return tensors

        kwargs = call_kwargs(request)
        with self._lock:
            started = time.perf_counter()
            images = self._pipeline(**kwargs, callback_on_step_end=on_step_end).images
            stats.busy_s += time.perf_counter() - started
            stats.calls += 1
        return encode_images_sync(images, "png", None)

    async def _watch(self, request: Request, progress: _Progress) -> None:
        while not await request.is_disconnected():
            await anyio.sleep(POLL_S)
        progress.gone_at_step = progress.steps

    async def _generate(self, request: Request) -> JSONResponse:
        try:
            job = self._request(await request.json())
        except (ValueError, TypeError) as exc:  # JSONDecodeError, a bad field
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        stats = self.stats
        stats.requests += 1
        stats.in_flight += 1
        progress = _Progress()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, request, progress)
                images = await anyio.to_thread.run_sync(self._call, job, progress)
                tg.cancel_scope.cancel()
        finally:
            stats.in_flight -= 1
        if progress.gone_at_step is not None:
            stats.disconnected += 1
            stats.steps_after_disconnect += progress.steps - progress.gone_at_step
        else:
            stats.completed += 1
        return JSONResponse(
            {
                "created": int(time.time()),
                "data": [{"b64_json": b64(image)} for image in images],
                "background": "opaque",
                "output_format": "png",
                "quality": "auto",
                "size": f"{job.width}x{job.height}",
            }
        )


def build(kind: str) -> NaiveServer:
    """The naive server for ``tiny_pipeline(kind, seed=0)``, with ``serve``'s defaults for it."""
    from omni_trio.runners import tiny_pipeline
    from omni_trio.serve._models import FALLBACK_GUIDANCE, TINY_STEPS, call_default, model_size

    pipeline = tiny_pipeline(kind, seed=0)
    return NaiveServer(
        pipeline,
        size=model_size(pipeline, tiny=True),
        steps=TINY_STEPS,
        guidance_scale=float(call_default(pipeline, "guidance_scale", FALLBACK_GUIDANCE)),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Build the tiny pipeline (one torch thread) and serve it with Uvicorn until SIGTERM."""
    import torch
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m benchmarks.naive", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", default="sd", help="tiny pipeline kind (default sd)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    server = build(args.kind)
    uvicorn.run(
        server.app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
