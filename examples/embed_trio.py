"""An engine inside a trio program: requests from several tasks, a timeout, one nursery.

Three tasks share one engine. Each generates under its own ``trio.move_on_after``:
one that runs out of time is aborted at its next step and its task moves on (the
engine has released it by then), while the others finish. Leaving ``open_engine``
waits for nothing but the engine's own shutdown.
"""

import trio

import omni_trio as ot
from omni_trio.testing import FakeRunner


async def client(engine: ot.Engine, name: str, steps: int, budget_s: float) -> None:
    request = ot.GenerationRequest(prompt=name, num_steps=steps, height=16, width=16)
    with trio.move_on_after(budget_s) as scope:
        output = await engine.generate(request, request_id=name)
        print(f"{name}: {output.metrics.steps_done} steps, {tuple(output.images.shape)}")
    if scope.cancelled_caught:
        print(f"{name}: out of time after {budget_s} s, aborted and released")


async def main() -> None:
    runner = FakeRunner(step_seconds=0.01)
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, engine, "quick", 5, 10.0)
            nursery.start_soon(client, engine, "slow", 500, 0.2)
            nursery.start_soon(client, engine, "steady", 20, 10.0)
        stats = engine.statistics()
        print(f"completed {stats.completed}, aborted {stats.aborted}")


if __name__ == "__main__":
    trio.run(main)
