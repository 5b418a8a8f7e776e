"""Update a served model's weights in place, then free its memory between rollouts.

An RL trainer alternates: rollouts on the current policy, a training step, new weights
into the engine, rollouts again. ``update_weights`` applies them without restarting
anything: the request in flight here finishes on the old weights (``policy="finish"``),
the one submitted meanwhile waits and runs on the new ones, and each output names the
version it ran on. ``sleep`` frees the weights' memory while the trainer needs it
(level 1: moved to host memory) and ``wake`` brings them back: the same request gives
the same images, bit for bit. On the CPU with a tiny random Flux; for a real model,
load a pipeline on its GPU and pass the trainer's state dict (or a ``.safetensors``
file, or a LoRA).
"""

import anyio
import anyio.lowlevel
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    request = ot.GenerationRequest(prompt="a red flower", num_steps=4, height=64, width=64, seed=7)
    # The trainer's new weights: here, another tiny Flux's transformer.
    trained = tiny_pipeline("flux", seed=1).transformer.state_dict()
    # Batches of one: the second request never joins the first one's steps.
    config = ot.EngineConfig(max_batch_size=1)
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("flux")), config) as engine:
        async with engine.submit(request) as in_flight:
            async for _ in in_flight:  # its first step is done: it runs
                break
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: engine.update_weights(trained, label="step-1"))
                await anyio.lowlevel.checkpoint()  # it waits for the request in flight
                async with engine.submit(request) as waited:
                    old, new = await in_flight.result(), await waited.result()
        print("in flight ran on", old.weight_version, "; the next on", new.weight_version)

        before = await engine.generate(request)
        report = await engine.sleep(1)
        print(f"asleep: {report.freed_bytes:,} bytes freed in {report.sleep_s:.3f} s")
        awake = await engine.wake()
        print(f"awake in {awake.wake_s:.3f} s")
        again = await engine.generate(request)
        print("the same images after the wake:", torch.equal(again.images, before.images))


if __name__ == "__main__":
    anyio.run(main, backend="trio")
