"""A tiny real model, one request, one image written to flower.png.

``tiny_pipeline("sd")`` builds a Stable Diffusion pipeline from a config with random
weights (no downloads); ``DiffusersRunner`` drives it step by step for the engine.
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        request = ot.GenerationRequest(prompt="a flower", num_steps=10, height=64, width=64, seed=1)
        output = await engine.generate(request)
    output.to_pil()[0].save("flower.png")
    print(output.images.shape, f"{output.metrics.total_s:.2f} s")


if __name__ == "__main__":
    anyio.run(main, backend="trio")  # or backend="asyncio"
