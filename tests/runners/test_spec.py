"""A model as one value (L89): a folder or a hub id through the Hugging Face cache, its
dtypes, its attention backend.

No network: a hub id is served from a cache folder the test fills from a saved tiny
pipeline (``HF_HOME/hub/models--ORG--NAME/snapshots/REV``, ``refs/main``), with
``HF_HUB_OFFLINE=1``. Requests run on the engine with one torch thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, ModelSpec, load, tiny_pipeline
from omni_trio.runners._spec import apply_dtype, load_pipeline_of
from tests.support.core import BUDGET
from tests.support.runners import hub_cache

#: How far a request's image through the engine may be from the pipeline's own call,
#: per dtype (images in [0, 1]): float32 is the same arithmetic in another order at
#: most; bfloat16 keeps 8 bits of mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HOME once, when it is first imported: here, maybe earlier.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(home / "hub"))
    return home


def own_call(pipe: Any, request: ot.GenerationRequest) -> torch.Tensor:
    generator = torch.Generator().manual_seed(request.seed or 0)
    with torch.no_grad():
        out = pipe(
            prompt=request.prompt, num_inference_steps=request.num_steps,
            height=request.height, width=request.width, guidance_scale=request.guidance_scale,
            generator=generator, output_type="pt",
        )  # fmt: skip
    images: torch.Tensor = out.images
    return images.float()


async def through_engine(runner: Any, request: ot.GenerationRequest) -> torch.Tensor:
    async with ot.open_engine(runner) as engine:
        return (await engine.generate(request)).images


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
async def test_a_hub_id_loads_offline_from_the_cache_and_equals_its_own_call(
    offline_hub: Path, dtype: str, one_torch_thread: None
) -> None:
    """L89: ``load(ModelSpec("org/name", dtype=...))`` reads the Hugging Face cache only
    (offline), builds the modules in that dtype, and a request through the engine equals
    the same pipeline's own call within the dtype's tolerance."""
    hub_cache(offline_hub, "flux", "tiny-org/tiny-flux")
    spec = ModelSpec(source="tiny-org/tiny-flux", dtype=dtype)
    assert spec.is_hub_id
    runner = load(spec)
    assert isinstance(runner, DiffusersRunner)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert runner._pipeline.transformer.dtype == torch_dtype
    request = ot.GenerationRequest(
        prompt="a red fox", num_steps=3, height=32, width=32, seed=4, guidance_scale=3.5
    )
    with anyio.fail_after(BUDGET):
        images = await through_engine(runner, request)
    pipe = load_pipeline_of(spec)
    pipe.set_progress_bar_config(disable=True)
    expected = own_call(pipe, request)
    assert (images - expected).abs().max().item() <= TOLERANCE[torch_dtype]


def test_an_id_not_in_the_cache_offline_is_one_line_naming_it_and_the_fetch(
    offline_hub: Path,
) -> None:
    """L89: offline, an id the cache lacks is one ``ValueError`` line naming the id and
    how to fetch it; never a download."""
    with pytest.raises(ValueError, match="is not in the Hugging Face cache") as info:
        load(ModelSpec(source="black-forest-labs/FLUX.1-dev", revision="v1"))
    message = str(info.value)
    assert "\n" not in message
    assert "'black-forest-labs/FLUX.1-dev' at revision 'v1' is not in the" in message
    assert "huggingface-cli download black-forest-labs/FLUX.1-dev --revision v1" in message


def test_a_spec_is_checked_and_a_folder_loads_with_its_component_dtypes(
    tmp_path: Path,
) -> None:
    """L89: a wrong dtype, a component named twice, a revision for a folder are refused by
    name; a folder loads in bf16 with its VAE kept in float32 when asked."""
    for fields, name in (
        ({"dtype": "float8"}, "dtype of dtype"),
        ({"component_dtypes": (("vae", "auto"),)}, "dtype of vae"),
        ({"component_dtypes": (("vae", "fp32"), ("vae", "bf16"))}, "named twice"),
    ):
        with pytest.raises(ValueError, match=name):
            ModelSpec(source="x", **fields)
    folder = tmp_path / "flux"
    tiny_pipeline("flux", seed=0).save_pretrained(folder)
    with pytest.raises(ValueError, match="only for a hub id"):
        load_pipeline_of(ModelSpec(source=str(folder), revision="main"))
    spec = ModelSpec(source=str(folder), dtype="bf16", component_dtypes=(("vae", "fp32"),))
    assert not spec.is_hub_id
    pipe = load_pipeline_of(spec)
    assert (pipe.transformer.dtype, pipe.vae.dtype) == (torch.bfloat16, torch.float32)


def test_a_tiny_pipeline_cast_keeps_its_models_float32_modules() -> None:
    """L89: a pipeline built in memory, cast to bf16, keeps the modules its model lists in
    float32 (Wan's norms and embeddings), as loading it in bf16 does."""
    pipe = apply_dtype(tiny_pipeline("wan", seed=0), torch.bfloat16, {})
    transformer = pipe.transformer
    keep = transformer._keep_in_fp32_modules
    assert keep
    kept = [
        module for path, module in transformer.named_modules()
        if any(part in keep for part in path.split(".")) and list(module.parameters())
    ]  # fmt: skip
    assert kept and all(p.dtype == torch.float32 for m in kept for p in m.parameters())
    assert transformer.proj_out.weight.dtype == torch.bfloat16


def test_an_attention_backend_is_set_or_refused_in_one_line(tmp_path: Path) -> None:
    """L92: a known backend this machine has is set on the denoiser; one it lacks, or an
    unknown name, is one ``ValueError`` line when the model loads."""
    folder = tmp_path / "flux"
    tiny_pipeline("flux", seed=0).save_pretrained(folder)
    pipe = load_pipeline_of(ModelSpec(source=str(folder), attention_backend="native"))
    assert pipe is not None
    for name, why in (("flash", "is not available here"), ("warp", "one of")):
        with pytest.raises(ValueError, match=why) as info:
            load_pipeline_of(ModelSpec(source=str(folder), attention_backend=name))
        assert "\n" not in str(info.value)


def test_the_servers_torch_free_tables_are_the_specs() -> None:
    """L89: the command line's parsers (``serve``'s and ``demo``'s) write the dtypes and
    compile modes out (they import no torch); they are the ones ``ModelSpec`` takes."""
    from omni_trio.cli import _spec_table
    from omni_trio.runners._compile import MODES
    from omni_trio.runners._spec import DTYPES

    assert (_spec_table.DTYPES, _spec_table.COMPILE_MODES) == (DTYPES, MODES)
