"""Abort a request mid-way: it stops at the next step and is never decoded.

A second request, submitted together with it, shares its batch and finishes
with exactly the image it would have had alone.
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=2)) as engine:
        keep = engine.submit(
            ot.GenerationRequest(prompt="a cat", num_steps=20, height=64, width=64, seed=1),
            request_id="keep",
        )
        drop = engine.submit(
            ot.GenerationRequest(prompt="a dog", num_steps=20, height=64, width=64, seed=2),
            request_id="drop",
        )
        async with keep, drop:
            async for event in drop:
                if event.step == 5:
                    released = await engine.abort("drop")  # returns once released
                    print("aborted after step", event.step, "released:", released)
                    break
            try:
                await drop.result()
            except ot.RequestAbortedError as exc:
                assert drop.metrics is not None
                print(
                    f"drop: {exc.reason}, {drop.metrics.steps_done} steps, "
                    f"abort latency {drop.metrics.abort_latency_s or 0:.4f} s"
                )
            output = await keep.result()
            print("keep:", tuple(output.images.shape), f"{output.metrics.steps_done} steps")
    print("VAE decodes run:", runner.decodes)  # 1: only the kept request


if __name__ == "__main__":
    anyio.run(main, backend="trio")
