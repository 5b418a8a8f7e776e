"""Serve LoRA adapters per request: different adapters, and none, in one batch.

Two tiny random LoRAs are made with peft for tiny Stable Diffusion (a real one comes
from a ``.safetensors`` file: ``engine.load_adapter("ink", "/loras/ink.safetensors")``),
loaded by name while the engine serves, and four requests share every step of one
batch: no adapter, ``ink``, ``ink`` at another scale, ``ink`` and ``film`` together.
Each row runs its own adapters at its own scales in one forward (L86); the listing
says what is loaded and who holds it (L85, L87).

Usage: .venv/bin/python examples/adapters.py   (seconds on a CPU; needs peft: the ``adapters``
extra)
"""

import tempfile
from pathlib import Path

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline


async def main() -> None:
    pipe = tiny_pipeline("sd")
    folder = Path(tempfile.mkdtemp())
    files = {
        name: tiny_lora(pipe, folder, name, seed=seed) for seed, name in enumerate(["ink", "film"])
    }
    runner = DiffusersRunner(pipe, max_adapters=2)
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
        for name, path in files.items():
            await engine.load_adapter(name, path)
        asks = {
            "none": {},
            "ink 0.8": {"ink": 0.8},
            "ink 0.3": {"ink": 0.3},
            "ink + film": {"ink": 0.5, "film": 0.5},
        }
        handles = {
            label: engine.submit(
                ot.GenerationRequest(
                    prompt="a lighthouse", num_steps=8, height=64, width=64, seed=1, adapters=ask
                )
            )
            for label, ask in asks.items()
        }
        images = {}
        for label, handle in handles.items():
            async with handle:
                images[label] = (await handle.result()).images.float()
        for label, image in images.items():
            change = (image - images["none"]).abs().mean().item()
            print(f"{label:10s} mean change from no adapter: {change:.4f}")
        for info in engine.adapters():
            print(f"{info.name}: {info.bytes} bytes, loaded={info.loaded}, held by {info.holders}")
        await engine.unload_adapter("film")
        print("loaded now:", [info.name for info in engine.adapters()])


if __name__ == "__main__":
    anyio.run(main, backend="trio")
