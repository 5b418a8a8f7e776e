"""Vary an image, then repaint half of it, with a diffusers pipeline driven step by step.

Image-to-image with ``strength`` 0.6 runs the last 6 of 10 steps from the noised
image (its step events count 6); inpainting repaints where the mask is white and
keeps the rest. Writes img2img.png and inpaint.png.

Usage: .venv/bin/python examples/img2img.py [IMAGE]   (default: a generated gradient; tiny SD)
"""

import sys
from typing import Any

import anyio
from PIL import Image

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline

SIZE = 64


def load_image() -> Image.Image:
    if len(sys.argv) > 1:
        with Image.open(sys.argv[1]) as image:
            return image.convert("RGB").resize((SIZE, SIZE), Image.Resampling.LANCZOS)
    gradient = Image.linear_gradient("L").resize((SIZE, SIZE))
    return Image.merge("RGB", (gradient, gradient.rotate(90), gradient.rotate(180)))


def request(**fields: Any) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt="a harbour at dawn", num_steps=10, height=SIZE, width=SIZE, **fields
    )


async def main() -> None:
    image = load_image()
    mask = Image.new("L", (SIZE, SIZE), 0)
    mask.paste(255, (SIZE // 2, 0, SIZE, SIZE))  # white: repaint the right half
    async with ot.open_engine(DiffusersRunner(tiny_pipeline("sd"))) as engine:
        varied = request(seed=1, image=image, strength=0.6)
        async with engine.submit(varied) as handle:
            async for event in handle:
                print(f"img2img step {event.step}/{event.total}")
            output = await handle.result()
        output.to_pil()[0].save("img2img.png")
        repainted = request(seed=2, image=image, mask=mask)
        (await engine.generate(repainted)).to_pil()[0].save("inpaint.png")
    print("wrote img2img.png and inpaint.png")


if __name__ == "__main__":
    anyio.run(main, backend="trio")
