"""Print a request's steps as they happen, with a preview at every fourth one.

A tiny Stable Diffusion pipeline (random weights) makes a 64x64 image in 12 steps.
Each step event prints ``step k/12``; steps 4, 8 and 12 carry a preview, a
``(1, 3, 8, 8)`` tensor (a latent-to-RGB projection at latent resolution, no VAE
decode), of which the shape is printed. Then the final image's shape is printed.
Nothing is saved. Previews are made only while someone reads the events.
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    async with ot.open_engine(runner) as engine:
        request = ot.GenerationRequest(
            prompt="a forest in fog", num_steps=12, height=64, width=64, seed=1, preview_every=4
        )
        async with engine.submit(request) as handle:
            async for event in handle:
                note = "" if event.preview is None else f"  preview {tuple(event.preview.shape)}"
                print(f"step {event.step:2d}/{event.total}{note}")
            output = await handle.result()
    print("final image", tuple(output.images.shape))


if __name__ == "__main__":
    anyio.run(main, backend="trio")
