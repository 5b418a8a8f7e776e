"""Shut an engine down with requests in every state, and see what each one got.

One request completed before the shutdown, one runs, one waits (a batch of one).
``aclose()`` stops admission, ends the waiting request at once, gives the running one
``shutdown_grace`` seconds, then stops it at the next step; the completed result stays
readable after it, and every engine thread is joined when ``aclose()`` returns.
"""

import anyio

import omni_trio as ot
from omni_trio.testing import FakeRunner, engine_threads


def request(steps: int) -> ot.GenerationRequest:
    return ot.GenerationRequest(prompt="a lake", num_steps=steps, height=16, width=16, seed=1)


async def main() -> None:
    runner = FakeRunner(step_seconds=0.01)
    config = ot.EngineConfig(max_batch_size=1, shutdown_grace=0.05)
    async with ot.open_engine(runner, config) as engine:
        async with engine.submit(request(2), request_id="done") as done:
            async for _ in done:  # read to the end; the result is kept for later
                pass
            async with (
                engine.submit(request(1000), request_id="running") as running,
                engine.submit(request(4), request_id="waiting") as waiting,
            ):
                async for _ in running:  # its first step ran: it holds the worker
                    break
                await engine.aclose()  # the whole sequence; leaving open_engine does the same
                for handle in (done, running, waiting):
                    try:
                        output = await handle.result()
                        print(handle.request_id, handle.status.name, output.images.shape)
                    except ot.EngineClosedError:
                        print(handle.request_id, handle.status.name, "EngineClosedError")
        try:
            engine.submit(request(2))
        except ot.EngineClosedError:
            print("submit after shutdown: EngineClosedError")
    print("engine threads left:", len(engine_threads()))


if __name__ == "__main__":
    anyio.run(main, backend="trio")
