"""Four requests share each step of one batch, and each gets the image it makes alone.

Requests of one size (the runner's batch key) that arrive together start in one batch
of up to ``max_batch_size``; one that arrives later joins the running batch at the next
step boundary (L60). Batching changes no output: each image equals the request's solo
image within float tolerance.
"""

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


def request(seed: int) -> ot.GenerationRequest:
    return ot.GenerationRequest(prompt="a kite", num_steps=4, height=64, width=64, seed=seed)


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        solo = [await engine.generate(request(seed)) for seed in range(4)]
        steps_alone = engine.statistics().batch_steps
        outputs: dict[int, ot.GenerationOutput] = {}

        async def one(seed: int) -> None:
            outputs[seed] = await engine.generate(request(seed))

        async with anyio.create_task_group() as tasks:
            for seed in range(4):
                tasks.start_soon(one, seed)
        steps_together = engine.statistics().batch_steps - steps_alone
    for seed in range(4):
        same = torch.allclose(outputs[seed].images, solo[seed].images, atol=1e-4)
        print(f"seed {seed}: same image in the batch as alone: {same}")
    print(f"engine steps: {steps_alone} one after another, {steps_together} together")


if __name__ == "__main__":
    anyio.run(main, backend="trio")
