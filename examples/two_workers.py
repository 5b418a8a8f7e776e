"""Two workers, one queue: the same pipeline loaded twice, one runner per device.

On a machine with GPUs, ``for_devices(make, "auto")`` gives one runner per GPU;
here two CPU workers share the cores (the engine gives torch one thread each on
two cores). Every image equals the one a single worker makes.
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, for_devices, tiny_pipeline


async def main() -> None:
    runners = for_devices(lambda device: DiffusersRunner(tiny_pipeline("sd").to(device)), "cpu,cpu")
    async with ot.open_engine(runners, ot.EngineConfig(max_batch_size=2)) as engine:
        requests = [
            ot.GenerationRequest(
                prompt=f"a boat, take {i}", num_steps=8, height=64, width=64, seed=i
            )
            for i in range(6)
        ]
        async with anyio.create_task_group() as group:
            for request in requests:
                group.start_soon(engine.generate, request)
        stats = engine.statistics()
    for worker in stats.workers:
        print(f"{worker.name}: {worker.steps_run} steps run, alive {worker.alive}")
    print("completed:", stats.completed, "of", len(requests))


if __name__ == "__main__":
    anyio.run(main, backend="trio")
