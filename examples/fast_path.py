"""Load a model the way users name it, in the precision they run it: one ``ModelSpec``.

A spec is the model's source (a diffusers folder, or a Hugging Face hub id read from
the cache), its dtype (``auto``: bf16 on CUDA, fp32 on a CPU), and what makes its step
fast: quantization, compiled blocks, an attention backend. ``load(spec)`` gives the
runner; every worker and rank of a server is built from the same spec (L89).

Here a tiny random Flux is saved to a temporary folder, then loaded twice from it, in
fp32 and in bf16; the two images differ by bf16's rounding only. On a GPU, add
``compile="blocks"`` (warm the sizes you serve, then ``runner.seal_compile()``) and
``quantization="int8-dynamic"`` or ``"fp8"``; ``python -m omni_trio serve`` takes the
same settings as ``--dtype``, ``--compile``, ``--quantization``.

Usage: .venv/bin/python examples/fast_path.py   (seconds on a CPU)
"""

import tempfile

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import ModelSpec, load, tiny_pipeline

REQUEST = ot.GenerationRequest(prompt="a lighthouse", num_steps=4, height=64, width=64, seed=1)


async def image_of(spec: ModelSpec) -> torch.Tensor:
    """One image of ``REQUEST`` from the model ``spec`` names."""
    async with ot.open_engine(load(spec)) as engine:
        output = await engine.generate(REQUEST)
    print(f"{spec.dtype}: an image of {tuple(output.images.shape)}")
    return output.images.float()


async def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        tiny_pipeline("flux").save_pretrained(folder)
        full = await image_of(ModelSpec(source=folder, dtype="fp32"))
        half = await image_of(ModelSpec(source=folder, dtype="bf16"))
    print(f"largest difference, bf16 vs fp32: {(full - half).abs().max().item():.3f}")


if __name__ == "__main__":
    anyio.run(main)
