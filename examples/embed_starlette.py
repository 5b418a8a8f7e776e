"""An engine inside a Starlette (or FastAPI) app on asyncio: opened in the lifespan.

The app's lifespan opens the engine and, when the server stops, shuts it down; each
request's handler calls ``engine.generate`` in its own task, so a client that goes away
(the server cancels the handler) aborts its request at the next step. Serve it with
``uvicorn examples.embed_starlette:app``; run as a script, it calls itself in-process
through httpx's ASGI transport. FastAPI takes the same ``lifespan=``.
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import omni_trio as ot
from omni_trio.testing import FakeRunner


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    runner = FakeRunner(step_seconds=0.01)  # a real model: omni_trio.runners.runner_for
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        app.state.engine = engine
        yield


async def generate(request: Request) -> JSONResponse:
    engine: ot.Engine = request.app.state.engine
    body = await request.json()
    try:
        output = await engine.generate(
            ot.GenerationRequest(
                prompt=body["prompt"], num_steps=body.get("steps", 8), height=64, width=64
            )
        )
    except ot.InvalidRequestError as exc:  # refused at submit, before any work (L4)
        return JSONResponse({"error": str(exc)}, status_code=400)
    except ot.QueueFullError:
        return JSONResponse({"error": "busy"}, status_code=503)
    metrics = output.metrics
    return JSONResponse({"shape": list(output.images.shape), "steps": metrics.steps_done})


app = Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)


async def main() -> None:
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        for body in ({"prompt": "a red flower", "steps": 4}, {"prompt": "x", "steps": 0}):
            response = await client.post("/generate", json=body)
            print(response.status_code, response.json())


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
