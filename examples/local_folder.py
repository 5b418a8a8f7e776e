"""Serve a diffusers model from a local folder, on a GPU when there is one.

``from_pretrained`` reads any diffusers folder (one ``save_pretrained`` wrote, or a
downloaded checkpoint) with ``local_files_only=True``, so nothing is fetched; ``.to()``
puts it on the device; ``runner_for`` picks the step-by-step ``DiffusersRunner`` for
the families it drives. Usage: ``python examples/local_folder.py [MODEL_DIR]``; without
a folder, a tiny random Stable Diffusion pipeline is saved to a temporary one first.
"""

import sys
import tempfile
from typing import Any

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import runner_for, tiny_pipeline


def load(folder: str) -> Any:
    from diffusers import DiffusionPipeline

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    loader: Any = DiffusionPipeline.from_pretrained
    return loader(folder, local_files_only=True, dtype=dtype).to(device)


async def main(folder: str) -> None:
    pipeline = load(folder)
    print("loaded", type(pipeline).__name__, "on", pipeline.device)
    async with ot.open_engine(runner_for(pipeline)) as engine:
        output = await engine.generate(
            ot.GenerationRequest(prompt="a lighthouse", num_steps=4, height=64, width=64, seed=1)
        )
    print("image", tuple(output.images.shape), "on", output.images.device)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        anyio.run(main, sys.argv[1], backend="trio")
    else:
        with tempfile.TemporaryDirectory() as folder:
            tiny_pipeline("sd").save_pretrained(folder)
            anyio.run(main, folder, backend="trio")
