"""What ``serve --model`` loads: a runner and the request defaults that suit its model.

The defaults are the model's own, read the way diffusers' pipelines read them when
a call leaves them out:

- size: the denoiser's ``config.sample_size`` times the pipeline's
  ``vae_scale_factor`` (512 for SD 1.5, 1024 for SD3), else the pipeline's
  ``default_sample_size`` times it (1024 for Flux); a model with a fixed size
  (unconditional UNets) uses that size;
- steps and guidance: the defaults of the pipeline's ``__call__``
  (``num_inference_steps``: 50 for SD and SDXL, 28 for SD3 and Flux, 50 for
  Qwen-Image; ``guidance_scale``: 7.5, 5.0, 7.0, 3.5; for Qwen-Image, whose
  request ``guidance_scale`` is its ``true_cfg_scale``, that one's: 4.0), the
  steps at most ``--max-steps``.

The built-in tiny models are built for 64x64 (tiny-unet: 32x32) and default to
``TINY_STEPS`` steps: they exist to be fast. ``tiny-wan`` and ``tiny-ltx`` make
videos (``/v1/videos``, L73), at 16 and 25 frames per second.

A spec that names no model is a ``ValueError``, a model that does not load a
``ModelError``; neither names a command-line option (the command line adds that).

With ``parallel`` (``("cfg", 2)``, ``("ulysses", 2)``, ``("ring", 2)``) the model is
one ``omni_trio.parallel.ParallelRunner``: one worker whose requests run over that
many ranks, each rank building the model itself (``devices``, if given, are the
ranks' devices).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runners import ModelSpec

__all__ = [
    "MODELS",
    "TINY_SIZE",
    "TINY_STEPS",
    "LoadedModel",
    "ModelError",
    "call_default",
    "is_hub_id",
    "is_video_model",
    "load_model",
    "model_folder",
    "model_size",
]

# The tables below are the families' (the tiny kinds of ``omni_trio.runners``, each
# family's pipelines), written out because ``import omni_trio.serve`` loads no torch
# and the families' modules do; tests/runners/test_families.py holds them to the
# families. What a loaded model's family says (its fps, its guidance parameter) is
# read off the family itself.

#: Built-in models: tiny real pipelines with random weights, and a fake one for tests.
MODELS = (
    "tiny-sd",
    "tiny-sdxl",
    "tiny-sd3",
    "tiny-flux",
    "tiny-qwen-image",
    "tiny-unet",
    "tiny-wan",
    "tiny-ltx",
    "fake",
)

#: The built-in models that make videos.
VIDEO_MODELS = ("tiny-wan", "tiny-ltx")
#: The pipeline classes of the video families ``DiffusersRunner`` drives (L70, L69).
VIDEO_PIPELINES = frozenset(
    {"WanPipeline", "WanImageToVideoPipeline", "LTXPipeline", "LTXImageToVideoPipeline"}
)

#: The default size of the tiny models (and of ``fake``), as (width, height).
TINY_SIZE = (64, 64)
#: The default step count of the tiny models (and of ``fake``).
TINY_STEPS = 20
#: What a pipeline whose ``__call__`` says nothing gets.
FALLBACK_STEPS = 30
FALLBACK_GUIDANCE = 7.5
#: The frames per second of a video runner of no family (a family says its own:
#: Wan 16, LTX-Video 25).
FALLBACK_FPS = 24.0


class ModelError(Exception):
    """A model that does not load, or not on a device; the loader's error is its cause.

    The message names the model and the device (``cannot load 'x' on cuda:1``).
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """The runners (one per device) and the defaults that suit them."""

    runners: tuple[Any, ...]
    name: str
    description: str
    size: tuple[int, int]
    steps: int
    guidance_scale: float
    #: A video model's frames per second (``None`` for an image model).
    fps: float | None = None


def call_default(pipeline: Any, name: str, fallback: float) -> float:
    """The default of ``pipeline.__call__``'s parameter ``name``, if it is a number."""
    try:
        default = inspect.signature(type(pipeline).__call__).parameters[name].default
    except (KeyError, TypeError, ValueError):
        return fallback
    is_number = isinstance(default, int | float) and not isinstance(default, bool)
    return default if is_number else fallback


def _sides(value: Any) -> tuple[int, int] | None:
    """A ``sample_size`` (an int, or a (height, width) pair) as (height, width)."""
    if isinstance(value, int) and value > 0:
        return value, value
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) for v in value)
    ):
        return int(value[0]), int(value[1])
    return None


def model_size(pipeline: Any, *, tiny: bool) -> tuple[int, int]:
    """The size ``pipeline`` generates when a call gives none, as (width, height)."""
    denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
    config = getattr(denoiser, "config", None)
    sides = _sides(getattr(config, "sample_size", None)) if config is not None else None
    if sides is None and not tiny:
        sides = _sides(getattr(pipeline, "default_sample_size", None))
    if sides is None:
        return TINY_SIZE
    scale = getattr(pipeline, "vae_scale_factor", 1)
    scale = scale if isinstance(scale, int) and scale > 0 else 1
    return sides[1] * scale, sides[0] * scale


#: A Hugging Face hub id: ``org/name`` (as ``runners.ModelSpec`` reads one).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` names a hub model (``org/name``, and no file or folder of that path)."""
    return _HUB_ID.fullmatch(spec) is not None and not Path(spec).expanduser().exists()


def model_folder(spec: str) -> Path:
    """The diffusers folder ``spec`` names (not one of ``MODELS``); checked, nothing loaded.

    Raises:
        ValueError: ``spec`` is not a diffusers folder; the message says why and
            names the built-in models.
    """
    from ..runners._load import check_pipeline_folder

    try:
        return check_pipeline_folder(spec)
    except ValueError as exc:
        raise ValueError(
            f"{exc}; the built-in models are {', '.join(MODELS)}, or give a hub id (org/name)"
        ) from None


def is_video_model(spec: str, revision: str | None = None) -> bool:
    """Whether ``spec`` (a built-in model, a diffusers folder, or a hub id in the Hugging Face
    cache) makes videos; nothing loads, nothing is downloaded.

    A folder's pipeline class is read from its ``model_index.json``; one that cannot be
    read (or a hub id not in the cache yet) is not a video model here (loading it says
    why).
    """
    if spec in MODELS:
        return spec in VIDEO_MODELS
    path: Path | None = Path(spec) / "model_index.json"
    if is_hub_id(spec):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(spec, "model_index.json", revision=revision)
        path = Path(cached) if isinstance(cached, str) else None
    try:
        index = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and index.get("_class_name") in VIDEO_PIPELINES


def _source(
    model: ModelSpec, *, tiny: bool
) -> tuple[Callable[..., Any], Callable[..., Any], str, str]:
    """How ``model`` is built: its pipeline's factory (a device in, a pipeline out; it
    pickles, for a rank), the runner it is wrapped in, its name in ``/v1/models`` and
    its description (``{}`` for the pipeline's class).

    Raises:
        ValueError: a setting that does not apply to it, or a folder that is not one.
    """
    from ..runners import DiffusersRunner, runner_for

    name = model.source
    wrap: Callable[..., Any]
    if tiny:
        if model.revision is not None or model.variant is not None:
            raise ValueError(f"revision, variant: for a hub id, not the built-in {name!r}")
        factory: Callable[..., Any] = functools.partial(_tiny_pipeline, model)
        wrap, shown, description = DiffusersRunner, name, "tiny {}, random weights"
    else:
        if not model.is_hub_id:
            model_folder(name)  # a plain error for a folder that is not one
        factory = functools.partial(_loaded_pipeline, model)
        wrap = runner_for
        shown = name if model.is_hub_id else Path(name).resolve().name
        description = "{} from " + name
    if model.compile is not None:
        wrap = functools.partial(DiffusersRunner, compile=model.compile)
        if model.compile_cache is not None:
            from ..runners._compile import use_compile_cache

            use_compile_cache(model.compile_cache)
    return factory, wrap, shown, description


def _loaded_pipeline(model: ModelSpec, device: str | None = None) -> Any:
    """The pipeline of a folder or a hub id, its progress bar off (a rank's factory: it
    pickles, and a rank builds the very same model)."""
    from ..runners._spec import load_pipeline_of

    loaded: Any = load_pipeline_of(model, device)
    loaded.set_progress_bar_config(disable=True)
    return loaded


def _tiny_pipeline(model: ModelSpec, device: str | None = None) -> Any:
    """A built-in tiny pipeline in the spec's dtypes, quantization and attention backend, on
    ``device``."""
    from ..runners import tiny_pipeline
    from ..runners._quantize import check_quantization, quantize_pipeline
    from ..runners._spec import apply_dtype, resolve_dtype, set_attention_backend

    check_quantization(model.quantization, device)
    pipe = tiny_pipeline(model.source.removeprefix("tiny-"), seed=0)
    if model.dtype != "auto" or model.component_dtypes or device is not None:
        components = {name: resolve_dtype(value, device) for name, value in model.component_dtypes}
        apply_dtype(pipe, resolve_dtype(model.dtype, device), components)
    if device is not None:
        pipe = pipe.to(device)
    # Built in memory: quantized once on its device, as a folder is as it loads.
    quantize_pipeline(pipe, model.quantization, model.quantize_components)
    if model.attention_backend is not None:
        set_attention_backend(pipe, model.attention_backend)
    return pipe


def _parallel_runner(
    factory: Callable[[], Any],
    parallel: tuple[str, int],
    devices: Sequence[str] | None,
    *,
    by_load: bool = False,
) -> Any:
    """One ``ParallelRunner`` over ``parallel``'s ranks, on ``devices`` if given."""
    from ..parallel import ParallelRunner

    layout, ranks = parallel
    degrees = {name: ranks if name == layout else 1 for name in ("cfg", "ulysses", "ring")}
    return ParallelRunner(
        factory,
        devices=devices,
        cfg=degrees["cfg"],
        ulysses=degrees["ulysses"],
        ring=degrees["ring"],
        by_load=by_load,
    )


def load_model(
    spec: str | ModelSpec,
    *,
    step_seconds: float,
    max_steps: int = 200,
    devices: Sequence[str] | None = None,
    runner_options: Mapping[str, Any] | None = None,
    parallel: tuple[str, int] | None = None,
    by_load: bool = False,
) -> LoadedModel:
    """Build the runners for ``spec``: a name in ``MODELS``, a diffusers folder or a hub id,
    or a ``ModelSpec`` of one with its dtype, attention backend, compilation and
    quantization (L89-L92).

    Args:
        spec: the model.
        step_seconds: the fake model's simulated step.
        max_steps: the most steps a default may be.
        devices: one runner per device named (L42; ``parse_devices`` checked
            them); ``None``: one runner, the pipeline where it loads (the CPU).
        runner_options: keyword options of each ``DiffusersRunner`` (the decode
            chunks' thresholds, L72); a pipeline served by its own call takes none.
        parallel: ``(layout, ranks)``: one ``ParallelRunner`` instead (L48, L49).
        by_load: its token split chosen per step by the batch (``by_load``).

    Raises:
        ValueError: ``spec`` names no model, or a setting does not apply to it.
        ModelError: the pipeline does not load, or not on a device.
    """
    from ..runners import ModelSpec

    model = spec if isinstance(spec, ModelSpec) else ModelSpec(source=spec)
    name = model.source
    if name == "fake":
        if parallel is not None:
            raise ValueError("the fake model runs in one process; parallel needs a real model")
        from ..testing import FakeRunner

        count = 1 if devices is None else len(devices)
        return LoadedModel(
            runners=tuple(FakeRunner(step_seconds=step_seconds) for _ in range(count)),
            name="fake",
            description=f"FakeRunner, {step_seconds * 1e3:g} ms per step",
            size=TINY_SIZE,
            steps=TINY_STEPS,
            guidance_scale=FALLBACK_GUIDANCE,
        )
    from ..runners._registry import family_class

    if parallel is not None and model.compile is not None:
        raise ValueError("compile: a parallel group's ranks run eager (not yet compiled)")
    if parallel is not None and model.quantization is not None:
        raise ValueError("quantization: a parallel group's ranks run unquantized (not yet)")
    tiny = name in MODELS
    factory, wrap, shown, description = _source(model, tiny=tiny)
    steps = TINY_STEPS
    pipelines: list[Any] = []
    runners: list[Any] = []
    if parallel is not None:
        try:
            runners.append(_parallel_runner(factory, parallel, devices, by_load=by_load))
        except Exception as exc:
            raise ModelError(f"cannot start {name!r} over {parallel[1]} ranks") from exc
        pipelines.append(runners[0].pipeline)
    for device in [] if parallel is not None else devices if devices is not None else [None]:
        try:
            pipeline: Any = factory(device)
            runners.append(wrap(pipeline, **(runner_options or {})))
        except Exception as exc:
            where = "" if device is None else f" on {device}"
            raise ModelError(f"cannot load {name!r}{where}") from exc
        pipelines.append(pipeline)
    pipeline = pipelines[0]
    runner = runners[0]
    where = "" if devices is None else f", on {', '.join(devices)}"
    if parallel is not None:
        where += f", {parallel[0]} over {parallel[1]} ranks"
        where += ", split by load" if by_load else ""
    where += "" if model.dtype == "auto" else f", {model.dtype}"
    where += "" if model.compile is None else ", compiled blocks"
    where += "" if model.quantization is None else f", {model.quantization}"
    description = description.format(type(pipeline).__name__) + where
    if not tiny:
        steps = int(call_default(pipeline, "num_inference_steps", FALLBACK_STEPS))
        steps = max(1, min(steps, max_steps))
    fixed = runner.capabilities.fixed_size
    size = (fixed[1], fixed[0]) if fixed is not None else model_size(pipeline, tiny=tiny)
    # A pipeline served by its own call has no family: diffusers' names, the fallbacks.
    family = family_class(pipeline)
    guidance = family.guidance_parameter if family is not None else "guidance_scale"
    fps = family.fps if family is not None else None
    video = runner.capabilities.frames is not None
    return LoadedModel(
        runners=tuple(runners),
        name=shown,
        description=description,
        size=size,
        steps=steps,
        guidance_scale=float(
            call_default(pipeline, guidance, FALLBACK_GUIDANCE) if guidance else FALLBACK_GUIDANCE
        ),
        fps=(fps or FALLBACK_FPS) if video else None,
    )
