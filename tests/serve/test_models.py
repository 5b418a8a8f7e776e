"""Real (tiny) diffusers models behind the app: L50 end to end, on trio and asyncio.

Determinism rules:
- the models are what ``python -m omni_trio serve --model`` loads (``load_model``):
  ``tiny_pipeline`` builds with seeded random weights (no download), by name or
  saved to a local folder; one torch thread;
- a fixed request seed must give the same image twice;
- in-process, inside the app's lifespan, with ``anyio.fail_after(BUDGET)``. (The
  servers themselves are tested with the fake model, in tests/serve/test_http.py.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
import pytest

from omni_trio.cli._options import make_service, service_options
from omni_trio.cli._serve import add_serve_arguments
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._models import load_model
from tests.support.core import BUDGET
from tests.support.serve import PATH, parse_sse, png_size, serving


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Stable Diffusion pipeline saved as a local diffusers folder."""
    from omni_trio.runners import tiny_pipeline

    folder = tmp_path_factory.mktemp("models") / "tiny-sd-folder"
    tiny_pipeline("sd").save_pretrained(folder)
    return folder


@pytest.mark.anyio
async def test_a_local_diffusers_folder_is_served_by_path(
    sd_folder: Path, one_torch_thread: None
) -> None:
    """L50: --model PATH loads a saved diffusers pipeline (local files only) and serves it
    step by step: the folder's name is the model id, the same seed gives the same PNG,
    progress and previews stream per step."""
    model = load_model(str(sd_folder), step_seconds=0.0)
    assert model.name == "tiny-sd-folder" and "StableDiffusionPipeline" in model.description
    config = ServeConfig(
        model_name=model.name, default_width=64, default_height=64, default_steps=3
    )
    service = Service(model.runners[0], config=config)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            models = (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny-sd-folder"]
            body = {"prompt": "a red flower", "seed": 5, "model": "tiny-sd-folder"}
            first = await client.post(PATH, json=body)
            second = await client.post(PATH, json=body)
            assert first.status_code == 200, first.text
            images = [r.json()["data"][0]["b64_json"] for r in (first, second)]
            assert images[0] == images[1] and png_size(images[0]) == (64, 64)
            streamed = await client.post(PATH, json={**body, "stream": True, "preview_every": 1})
            events = parse_sse(streamed.text)
            assert [d["step"] for e, d in events if e == "image_generation.progress"] == [1, 2, 3]
            assert sum(e == "image_generation.partial_image" for e, _ in events) == 3
            assert events[-1][1]["b64_json"] == images[0]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sd3", "tiny-flux", "tiny-unet"])
async def test_every_tiny_model_name_serves(name: str, one_torch_thread: None) -> None:
    """L50: each built-in model name loads a real tiny pipeline that serves its default size."""
    model = load_model(name, step_seconds=0.0)
    width, height = model.size
    config = ServeConfig(
        model_name=model.name,
        default_width=width,
        default_height=height,
        default_steps=2,
        default_guidance_scale=model.guidance_scale,
    )
    service = Service(model.runners[0], config=config)
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            response = await client.post(PATH, json={"prompt": "a cat"})
            assert response.status_code == 200, response.text
            assert png_size(response.json()["data"][0]["b64_json"]) == (width, height)


def test_the_command_line_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    """--model must be a built-in name, a diffusers folder or a hub id (L89); anything else
    stops before serving, with one line and the usage status."""
    from omni_trio.cli import main

    assert main(["serve", "--model", "/no/such/folder"]) == 2
    assert capsys.readouterr().err == (
        "omni-trio: error: --model: no such folder: '/no/such/folder';"
        " the built-in models are tiny-sd, tiny-sdxl, tiny-sd3, tiny-flux, tiny-qwen-image,"
        " tiny-unet, tiny-wan, tiny-ltx, fake, or give a hub id (org/name)\n"
    )
    with pytest.raises(SystemExit):
        main(["serve", "--model", "fake", "--default-size", "64"])  # argparse: exit 2


@pytest.fixture(scope="module")
def sd_folder_128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SD folder whose UNet says sample_size 16: its own default is 128x128."""
    from omni_trio.runners import tiny_pipeline

    pipeline = tiny_pipeline("sd")
    pipeline.unet.register_to_config(sample_size=16)
    folder = tmp_path_factory.mktemp("models") / "sd-128"
    pipeline.save_pretrained(folder)
    return folder


@pytest.mark.anyio
async def test_a_folder_is_served_at_its_models_own_defaults(
    sd_folder_128: Path, one_torch_thread: None
) -> None:
    """L50: a folder's defaults are its model's: the UNet's sample_size times the VAE
    scale factor (16 x 8 = 128), and the steps and guidance of the pipeline's own
    __call__ (50 and 7.5 for Stable Diffusion, the steps capped at --max-steps);
    /v1/models says them; an explicit --default-size wins."""
    model = load_model(str(sd_folder_128), step_seconds=0.0)
    assert (model.size, model.steps, model.guidance_scale) == ((128, 128), 50, 7.5)
    assert load_model(str(sd_folder_128), step_seconds=0.0, max_steps=20).steps == 20
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    service = make_service(
        service_options(parser.parse_args(["--model", str(sd_folder_128)])), model
    )
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            card = (await client.get("/v1/models")).json()["data"][0]
    assert (card["default_size"], card["default_steps"], card["default_guidance_scale"]) == (
        "128x128",
        50,
        7.5,
    )
    explicit = parser.parse_args(["--model", str(sd_folder_128), "--default-size", "64x64"])
    config = make_service(service_options(explicit), model).config
    assert (config.default_width, config.default_height) == (64, 64)


def test_the_decode_options_reach_every_runner(
    capsys: pytest.CaptureFixture[str], one_torch_thread: None
) -> None:
    """L72: --decode-tile-above and --decode-framewise-above set each runner's decode
    chunks ("never" turns one off); a bad value stops with one line naming it."""
    from omni_trio.cli import main

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    options = service_options(parser.parse_args(["--model", "tiny-sd"]))
    assert (options.decode_tile_above, options.decode_framewise_above) == (1024 * 1024, None)
    args = parser.parse_args(
        ["--model", "tiny-ltx", "--decode-tile-above", "never", "--decode-framewise-above", "16"]
    )
    options = service_options(args)
    assert (options.decode_tile_above, options.decode_framewise_above) == (None, 16)
    model = options.load_model()
    chunks = [runner._family.chunks for runner in model.runners]
    assert [(c.tile_above, c.framewise_above) for c in chunks] == [(None, 16)]
    with pytest.raises(SystemExit):
        main(["serve", "--model", "fake", "--decode-tile-above", "0"])
    assert "--decode-tile-above: expected an integer >= 1, got '0'" in capsys.readouterr().err
