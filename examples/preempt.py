"""An urgent request suspends a long one at a step boundary; the long one resumes exactly.

The long request (priority 0) runs alone in a batch of one. An urgent request
(priority 5) arrives after its fifth step: at the next boundary the long one is
suspended (it reads WAITING), the urgent one runs, and then the long one resumes
from the step it reached, with the image it makes uninterrupted.
"""

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


def request(prompt: str, steps: int, priority: int = 0) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=prompt, num_steps=steps, height=64, width=64, seed=3, priority=priority
    )


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    config = ot.EngineConfig(max_batch_size=1)
    async with ot.open_engine(runner, config) as engine:
        alone = await engine.generate(request("a long job", 20))
        async with engine.submit(request("a long job", 20), request_id="long") as long:
            async for event in long:
                if event.step == 5:
                    break
            urgent = await engine.generate(request("now", 4, priority=5))
            print("urgent done; preemptions so far:", engine.statistics().preemptions)
            resumed = await long.result()
    metrics = resumed.metrics
    print(f"long: {metrics.preemptions} preemption(s), {metrics.suspended_s:.3f} s suspended")
    print("urgent waited", f"{urgent.metrics.queue_wait_s * 1e3:.1f} ms for the worker")
    print("resumed image equals the uninterrupted one:", torch.equal(resumed.images, alone.images))


if __name__ == "__main__":
    anyio.run(main, backend="trio")
