"""Quantization (L91, L93): int8 through torchao, GGUF through diffusers, every rule kept.

What is asserted, on tiny Flux (one double and one single block, 32 px, 4 steps):

- int8 (weight-only and dynamic) holds the denoiser in under 0.3 of its float32 bytes
  (the quantized tensors counted as stored: int8 values and their scales), and its
  images stay within a PSNR floor of the float32 model's, same seeds (measured here:
  57-65 dB; the floor, 50 dB, is far above a LoRA's own effect, 36 dB, so a dropped
  adapter or a wrong scale fails it);
- a request alone equals it batched within batching's tolerance (each row keeps its
  own activation scales), with adapters per row on quantized layers, preempted and
  resumed or restored from a checkpoint exactly, with a step cache skipping per row
  as alone, compiled within 1e-4 of eager;
- a folder quantizes as it loads (diffusers' quantizers) to the same weights as a
  pipeline quantized in memory; a GGUF file replaces a folder's denoiser;
- what cannot run is refused in one line by name: fp8 off CUDA, an unknown mode,
  GGUF on a pipeline built in memory, a component the pipeline lacks, a parallel
  group.

Determinism: seeded tiny pipelines, one torch thread, the engine's own batching (a
request alone, then the same requests submitted at once into batches of 3), the
preemption driven by a gated runner (``resumed_and_uninterrupted``); the compiled test
counts nothing and times nothing, its compile cache in a folder of the session's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from benchmarks.cache import churned as churned_run
from benchmarks.cache import company, request_of, stepped
from omni_trio.runners import DiffusersRunner, ModelSpec, tiny_lora, tiny_pipeline
from omni_trio.runners._checkpoint import model_key
from omni_trio.runners._quantize import (
    MODES,
    quantize_pipeline,
    torchao_quantization,
    weight_bytes,
)
from omni_trio.runners._spec import load_pipeline_of
from tests.support.core import BUDGET
from tests.support.runners import (
    compile_cache_in,
    images_together,
    resumed_and_uninterrupted,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The int8 modes, which run on a CPU.
INT8 = ("int8-weight", "int8-dynamic")
#: The least PSNR (dB) of a quantized image against the float32 one, same seed.
PSNR_FLOOR = 50.0
#: How far a request batched may be from it alone (images in [0, 1]).
BATCHED = 1e-4


@cache
def plain() -> Any:
    """Tiny Flux in float32."""
    return tiny_pipeline("flux")


@cache
def quantized(mode: str) -> Any:
    """Tiny Flux, its transformer quantized (in memory, as serve quantizes a tiny model)."""
    return quantize_pipeline(tiny_pipeline("flux"), mode, None)


def request(seed: int, steps: int = 4, **fields: Any) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a fox {seed}", num_steps=steps, height=32, width=32, seed=seed,
        guidance_scale=3.5, **fields,
    )  # fmt: skip


def psnr(image: torch.Tensor, reference: torch.Tensor) -> float:
    """The peak signal-to-noise ratio (dB) of ``image`` against ``reference``, in [0, 1]."""
    error = torch.mean((image.float() - reference.float()) ** 2).item()
    return math.inf if error == 0 else 10 * math.log10(1 / error)


async def one_by_one(runner: Any, requests: list[ot.GenerationRequest]) -> list[torch.Tensor]:
    """Each request alone, in order; the engine closes the runner at its exit."""
    async with ot.open_engine(runner) as engine:
        return [(await engine.generate(r)).images for r in requests]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", INT8)
async def test_int8_holds_the_denoiser_in_under_a_third_and_keeps_its_images(mode: str) -> None:
    """L91, L81: the int8 transformer's weights (int8 values and their scales, as stored)
    are at most 0.3 of its float32 bytes, the text encoders untouched; each image is
    within the PSNR floor of the float32 model's, same seed; and a request alone equals
    it batched with the others within 1e-4."""
    pipe = quantized(mode)
    assert weight_bytes(pipe.transformer) <= 0.3 * weight_bytes(plain().transformer)
    for name in ("text_encoder", "text_encoder_2", "vae"):
        assert weight_bytes(pipe.components[name]) == weight_bytes(plain().components[name])
    requests = [request(0), request(1, steps=3), request(2, num_images=2)]
    with anyio.fail_after(BUDGET * 2):
        reference = await one_by_one(DiffusersRunner(plain()), requests)
        alone = await one_by_one(DiffusersRunner(pipe), requests)
        batched = await images_together(DiffusersRunner(pipe, max_batch_size=3), requests)
    for mine, theirs, joined in zip(alone, reference, batched, strict=True):
        assert psnr(mine, theirs) >= PSNR_FLOOR
        assert (mine - joined).abs().max().item() <= BATCHED


@pytest.mark.anyio
async def test_adapters_run_per_row_on_quantized_layers(tmp_path: Path) -> None:
    """L91, L86: a LoRA loads onto int8 layers (PEFT's torchao LoRA layer) and runs per
    row: rows with and without it, at two scales, batched, each within 1e-4 of its run
    alone and within the PSNR floor of the float32 model with the same LoRA; the LoRA
    still changes the image as much as on float32 (its own PSNR within 1 dB)."""
    from peft.tuners.lora.torchao import TorchaoLoraLinear

    # Pipelines of its own: PEFT's LoRA layers stay in a model once loaded.
    base, pipe = (
        tiny_pipeline("flux"),
        quantize_pipeline(tiny_pipeline("flux"), "int8-weight", None),
    )
    lora = tiny_lora(base, tmp_path, "ink", seed=1, text=False)
    requests = [request(0), request(0, adapters={"ink": 1.0}), request(1, adapters={"ink": 0.5})]
    runners = [DiffusersRunner(p, max_batch_size=3) for p in (base, pipe, pipe)]
    for runner in runners:
        runner.load_adapter("ink", lora)
    layers = {type(m) for m in pipe.transformer.modules() if isinstance(m, TorchaoLoraLinear)}
    assert layers == {TorchaoLoraLinear}
    with anyio.fail_after(BUDGET * 2):
        reference = await one_by_one(runners[0], requests)
        alone = await one_by_one(runners[1], requests)
        batched = await images_together(runners[2], requests)
    for mine, theirs, joined in zip(alone, reference, batched, strict=True):
        assert psnr(mine, theirs) >= PSNR_FLOOR
        assert (mine - joined).abs().max().item() <= BATCHED
    assert abs(psnr(alone[1], alone[0]) - psnr(reference[1], reference[0])) <= 1.0


@pytest.mark.anyio
async def test_a_quantized_request_resumes_and_restores_exactly() -> None:
    """L91, L61, L78: on int8-dynamic Flux, a request preempted after its first step and
    resumed from host memory equals its uninterrupted run bitwise; resumed in a fresh
    engine from its checkpoint after step 2, too; the checkpoint's model key names the
    quantization (a float32 model's differs, as int8-weight's does)."""
    pipe = quantized("int8-dynamic")
    low, high = request(3), request(4, steps=2, priority=1)
    resumed, uninterrupted, _ = await resumed_and_uninterrupted(pipe, low, high, park_on_host=True)
    assert torch.equal(resumed.images, uninterrupted.images)
    taken: list[ot.Checkpoint] = []
    policy = ot.CheckpointPolicy(every_s=0, sink=taken.append)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(pipe)) as engine:
            async with engine.submit(low, checkpoint=policy) as handle:
                whole = await handle.result()
        async with ot.open_engine(DiffusersRunner(pipe)) as engine:
            async with engine.submit(low, resume_from=taken[1].data) as handle:
                restored = await handle.result()
    assert taken[1].step == 2
    assert torch.equal(restored.images, whole.images)
    keys = {model_key("flux", p) for p in (pipe, plain(), quantized("int8-weight"))}
    assert len(keys) == 3


def test_a_step_cache_on_a_quantized_model_skips_per_row() -> None:
    """L91, L81: a first-block-cached request on int8-dynamic Flux skips (its pattern has
    skips), and in a batch whose members join and leave its pattern is the same as
    alone and its image within 1e-4."""
    import random

    runner = DiffusersRunner(quantized("int8-dynamic"), max_batch_size=4)
    policy = ot.StepCache(kind="first-block", threshold=0.35)
    cached = request_of("flux", num_steps=8, seed=5, cache=policy)  # the company's size
    try:
        image, metrics = stepped(runner, cached)
        assert metrics is not None and any("S" in row for row in metrics.pattern)
        for seed in range(2):
            joined, joined_metrics = churned_run(
                runner, cached, random.Random(seed), lambda g, n: company("flux", g, n)
            )
            assert joined_metrics is not None
            assert joined_metrics.pattern == metrics.pattern
            torch.testing.assert_close(joined, image, atol=BATCHED, rtol=0)
    finally:
        runner.close()


@pytest.fixture
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Torch's compile caches in a folder of the session's, the variables restored."""
    with compile_cache_in(tmp_path_factory.mktemp("quantized-compile-cache")):
        yield


@pytest.mark.usefixtures("compile_cache")
def test_quantized_and_compiled_stays_within_the_quantizations_tolerance() -> None:
    """L91, L93: int8-dynamic Flux with its blocks compiled (the fast path on a CPU): a
    request's image is within the PSNR floor of the eager quantized runner's and of the
    float32 model's (inductor rounds the activations' int8 values in its own order: a
    value a quantization level apart here and there, 2.5e-3 at most here, not 1e-4 as
    float32 compiled)."""
    r = request(6)
    runner = DiffusersRunner(quantized("int8-dynamic"), compile="blocks")
    assert runner.compiled_blocks == 2
    try:
        compiled, _ = stepped(runner, r)
    finally:
        runner.close()
    eager, _ = stepped(DiffusersRunner(quantized("int8-dynamic")), r)
    reference, _ = stepped(DiffusersRunner(plain()), r)
    assert psnr(compiled, eager) >= PSNR_FLOOR
    assert psnr(compiled, reference) >= PSNR_FLOOR


def write_gguf(pipe: Any, path: Path) -> Path:
    """The transformer's weights as a GGUF file: its matrices in Q8_0, the rest float32."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="flux")
    for name, tensor in pipe.transformer.state_dict().items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(array, kind)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.anyio
async def test_a_folder_quantizes_as_it_loads_and_a_gguf_file_replaces_its_denoiser(
    tmp_path: Path,
) -> None:
    """L91, L89: a saved tiny Flux loaded with int8-dynamic (diffusers' quantizers, T5 too
    by ``quantize_components``) holds the same int8 transformer as the in-memory one, its
    image identical; the same folder with a Q8_0 GGUF file of its transformer runs
    within the PSNR floor of float32, in under 0.3 of its bytes."""
    Int8Tensor = torchao_quantization().Int8Tensor

    folder = tmp_path / "flux"
    plain().save_pretrained(folder)
    spec = ModelSpec(
        source=str(folder),
        quantization="int8-dynamic",
        quantize_components=("transformer", "text_encoder_2"),
    )
    loaded = load_pipeline_of(spec)
    for model in (loaded.transformer, loaded.text_encoder_2):
        assert any(isinstance(p, Int8Tensor) for p in model.parameters())
    assert not any(isinstance(p, Int8Tensor) for p in loaded.text_encoder.parameters())
    gguf_file = write_gguf(plain(), tmp_path / "transformer.gguf")
    from_gguf = load_pipeline_of(
        ModelSpec(source=str(folder), quantization="gguf", gguf_file=str(gguf_file))
    )
    assert weight_bytes(from_gguf.transformer) <= 0.3 * weight_bytes(plain().transformer)
    in_memory = quantize_pipeline(tiny_pipeline("flux"), "int8-dynamic", spec.quantize_components)
    for pipe in (loaded, from_gguf):
        pipe.set_progress_bar_config(disable=True)
    r = request(8)
    with anyio.fail_after(BUDGET * 2):
        [mine] = await one_by_one(DiffusersRunner(loaded), [r])
        [theirs] = await one_by_one(DiffusersRunner(in_memory), [r])
        [from_file] = await one_by_one(DiffusersRunner(from_gguf), [r])
        [reference] = await one_by_one(DiffusersRunner(plain()), [r])
    assert torch.equal(mine, theirs)
    assert psnr(from_file, reference) >= PSNR_FLOOR


def refusal(call: Callable[[], object]) -> str:
    """The one line ``call`` is refused with (a ``ValueError``, or a ``ModelError``'s cause)."""
    from omni_trio.serve._models import ModelError

    with pytest.raises((ValueError, ModelError)) as refused:
        call()
    error = refused.value.__cause__ if isinstance(refused.value, ModelError) else refused.value
    return str(error)


def test_what_cannot_run_is_refused_in_one_line_by_name() -> None:
    """L91, L93: fp8 on a CPU, an unknown mode, GGUF without its file or on a pipeline built
    in memory, components without a mode or that the pipeline lacks, and a quantized
    parallel group are each one line naming what is refused; serve's torch-free table
    is the modes."""
    from omni_trio.cli import _spec_table
    from omni_trio.serve._models import load_model

    def serve(mode: str, **options: Any) -> object:
        return load_model(
            ModelSpec(source="tiny-flux", quantization=mode), step_seconds=0, **options
        )

    assert _spec_table.QUANTIZATIONS == MODES
    refused = {
        "quantization fp8 runs on CUDA only, and this model loads on cpu: use int8-weight or"
        " int8-dynamic here": lambda: serve("fp8"),
        "quantization: one of int8-weight, int8-dynamic, fp8, gguf, got 'int4'": lambda: ModelSpec(
            source="tiny-flux", quantization="int4"
        ),
        "gguf_file: with quantization gguf, and only with it": lambda: ModelSpec(
            source="tiny-flux", quantization="gguf"
        ),
        "quantization gguf: a GGUF file replaces the denoiser of a folder or a hub id; this"
        " pipeline is built in memory": lambda: quantize_pipeline(plain(), "gguf", None),
        "quantize_components: only with an int8 or fp8 quantization": lambda: ModelSpec(
            source="tiny-flux", quantize_components=("transformer",)
        ),
        "quantize_components: this pipeline has no model 'unet' (its models: text_encoder,"
        " text_encoder_2, transformer, vae)": lambda: quantize_pipeline(
            plain(), "int8-weight", ("unet",)
        ),
        "quantization: a parallel group's ranks run unquantized (not yet)": lambda: serve(
            "int8-weight", parallel=("cfg", 2)
        ),
    }
    assert {message: refusal(call) for message, call in refused.items()} == {
        message: message for message in refused
    }


def test_serve_options_quantize_a_tiny_model_as_the_command_line_says() -> None:
    """L91, L89: ``serve --quantization int8-dynamic --quantize-components
    transformer,text_encoder_2`` is two fields of ``ServiceOptions``, and the model they
    load has those two models quantized, the others not; its description says so."""
    import argparse

    from omni_trio.cli._options import service_options
    from omni_trio.cli._serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = "--model tiny-flux --quantization int8-dynamic"
    args = parser.parse_args(
        [*given.split(), "--quantize-components", "transformer,text_encoder_2"]
    )
    options = service_options(args)
    assert (options.quantization, options.quantize_components) == (
        "int8-dynamic",
        ("transformer", "text_encoder_2"),
    )
    loaded = options.load_model()
    [runner] = loaded.runners
    try:
        pipe = runner._pipeline  # the pipeline the runner drives
        quantized = {
            name
            for name, model in pipe.components.items()
            if isinstance(model, torch.nn.Module)
            and any(isinstance(p, torchao_quantization().Int8Tensor) for p in model.parameters())
        }
        assert quantized == {"transformer", "text_encoder_2"}
        assert loaded.description.endswith(", int8-dynamic")
    finally:
        runner.close()
