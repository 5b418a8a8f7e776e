"""An engine inside a Starlette (or FastAPI) app on asyncio: opened in the lifespan.

The app's lifespan opens the engine and, when the server stops, shuts it down; each
handler calls ``engine.generate`` in its own task. An ASGI server does not cancel a
handler whose client went away, it says so through ``receive()``: the handler watches
for that and cancels its own scope, which aborts the request at its next step. Serve it
with ``uvicorn examples.embed_starlette:app``; run as a script, it calls itself
in-process (httpx's ASGI transport), then plays a client that hangs up mid-way.
FastAPI takes the same ``lifespan=``.
"""

import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import omni_trio as ot
from omni_trio.testing import FakeRunner


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    runner = FakeRunner(step_seconds=0.01)  # a real model: omni_trio.runners.runner_for
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        app.state.engine = engine
        yield


async def answer(engine: ot.Engine, body: dict[str, Any]) -> Response:
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
    return JSONResponse({"shape": list(output.images.shape), "steps": output.metrics.steps_done})


async def cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()  # the client left: generate() aborts its request and waits for the release


async def generate(request: Request) -> Response:
    engine: ot.Engine = request.app.state.engine
    body = await request.json()
    response = Response(status_code=499)  # what is left when the client went away
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cancel_on_disconnect, request, tasks.cancel_scope)
        response = await answer(engine, body)
        tasks.cancel_scope.cancel()  # answered: stop watching
    return response


app = Starlette(routes=[Route("/generate", generate, methods=["POST"])], lifespan=lifespan)


async def hang_up_after(seconds: float) -> None:
    """Call the app as an ASGI server would, for a client that leaves after ``seconds``."""
    body = json.dumps({"prompt": "a long one", "steps": 1000}).encode()
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.sleep(seconds)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        pass  # nobody is listening any more

    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": []}
    await app(scope, receive, send)


async def main() -> None:
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
    ):
        for body in ({"prompt": "a red flower", "steps": 4}, {"prompt": "x", "steps": 0}):
            response = await client.post("/generate", json=body)
            print(response.status_code, response.json())
        await hang_up_after(0.1)
        stats = app.state.engine.statistics()
        print(f"a client hung up: aborted {stats.aborted}, running {stats.running}")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
