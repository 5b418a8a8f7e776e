"""Watch a request's progress with live previews, and save the last preview.

Previews are computed only while someone reads the events (a cheap latent-to-RGB
projection, every ``preview_every``-th step).
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
