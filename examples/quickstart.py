"""Generate an image, watch its steps, then abort a second request mid-way."""

import anyio

import omni_trio as ot
from omni_trio.testing import FakeRunner


async def main() -> None:
    runner = FakeRunner(step_seconds=0.01)  # a real model: omni_trio.runners
    config = ot.EngineConfig(max_batch_size=4)
    async with ot.open_engine(runner, config) as engine:
        request = ot.GenerationRequest(
            prompt="a flower", num_steps=10, height=64, width=64, seed=42
        )
        async with engine.submit(request, request_id="r1") as handle:
            async for event in handle:
                print(f"step {event.step}/{event.total}")
            output = await handle.result()
        print(output.images.shape, f"{output.metrics.total_s * 1e3:.1f} ms")

        # Leaving the block early aborts the request at the next step boundary,
        # and the exit returns only once the worker has let go of it.
        async with engine.submit(request, request_id="r2") as handle:
            async for event in handle:
                if event.step == 3:
                    break
        print(handle.status, engine.statistics())


if __name__ == "__main__":
    anyio.run(main, backend="trio")
