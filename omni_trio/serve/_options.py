"""Build a service from options: the one way ``serve``, ``serve --ray`` and a Ray replica do.

``ServiceOptions`` says what to serve (a model's name or folder), where (its
devices) and how (the engine's limits, the request defaults, the upload limits,
the video jobs, the decode chunks); it is plain data, so it travels to a Ray
replica, which builds its service there. ``build_service`` loads the model and
builds the ``Service``: what the options leave to the model (``None``) is the
model's own (``_models``: its name, size, steps, guidance scale, frames per
second), and the defaults are checked once, as a request that uses them all.

The errors name the options' fields, never a command-line option: the command
line (``omni_trio.cli``) turns its arguments into ``ServiceOptions`` and names
its own options in what it prints. It declares each of its options against a
field here, by the field's name, and takes the field's default unless the option
says otherwise: a field added or renamed needs its option there (its test says so).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from .._adapters import AdapterError
from .._config import EngineConfig
from .._errors import InvalidRequestError
from .._request import GenerationRequest
from .._results import ResultCache
from .._runner import AdapterRunner
from ._app import Service
from ._config import OutputConfig, ServeConfig, with_defaults
from ._keys import ApiKeys
from ._models import FALLBACK_FPS, LoadedModel, load_model
from ._tracing import Tracing
from ._upload import UploadLimits
from ._video_body import default_frames
from ._warmup import warm_up_request
from .jobs import JobStore, VideoConfig, postgres_store

if TYPE_CHECKING:
    from ..runners import ModelSpec

__all__ = ["SPEC_FIELDS", "OptionError", "ServiceOptions", "build_service", "spec_options"]

#: The field of ``ServiceOptions`` that carries each field of ``runners.ModelSpec`` (L89).
SPEC_FIELDS = {
    "source": "model",
    "revision": "revision",
    "variant": "variant",
    "dtype": "dtype",
    "attention_backend": "attention_backend",
    "compile": "compile",
    "compile_cache": "compile_cache",
    "quantization": "quantization",
    "quantize_components": "quantize_components",
    "gguf_file": "gguf_file",
}

#: Why ``ServiceOptions`` carries no value of a spec's other fields but their defaults.
_NOT_CARRIED = {
    "component_dtypes": "a served model has one dtype (serve --dtype); load the"
    " pipeline in a factory to give its components their own",
    "offline": "a replica honours HF_HUB_OFFLINE in its own environment (runtime_env's"
    " env_vars); leave it None",
}

# Where the options leave a setting as the HTTP layer's own, its default is theirs.
_SERVE = ServeConfig()
_VIDEO = VideoConfig()

#: The field of ``ServiceOptions`` that sets each request field a default fills.
_DEFAULT_FIELDS = {
    "num_frames": "video_fps",
    "width": "default_size",
    "height": "default_size",
    "num_steps": "default_steps",
    "guidance_scale": "default_guidance_scale",
    "cache": "default_cache",  # engine_config.default_cache (L80)
}


class OptionError(ValueError):
    """A default of ``ServiceOptions`` that the model refuses; ``option`` names the field.

    Args:
        option: the field of ``ServiceOptions`` (``default_size``, ``video_fps``, ...;
            ``default_cache`` for ``engine_config``'s).
        detail: what is wrong with it.
    """

    def __init__(self, option: str, detail: str) -> None:
        super().__init__(f"{option}: {detail}")
        self.option = option
        self.detail = detail

    def __reduce__(self) -> tuple[type[OptionError], tuple[str, str]]:
        # Its arguments are not its message: a Ray replica's error is pickled.
        return type(self), (self.option, self.detail)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceOptions:
    """What to serve, where and how: everything ``build_service`` needs, as plain data.

    ``None`` leaves a setting to the model: its name, default size, steps and
    guidance scale, and a video model's frames per second.

    Args:
        model: one of ``MODELS`` (``fake``, ``tiny-sd``, ...), a diffusers folder, or a
            Hugging Face hub id (``org/name``, from the cache when offline; L89).
        revision: the hub id's revision (a branch, tag or commit).
        variant: the weight files' variant (``fp16``).
        dtype: ``auto`` (bf16 on CUDA, fp32 on a CPU), ``fp32``, ``fp16``, ``bf16`` (L89).
        attention_backend: a diffusers attention backend by name; one this machine
            lacks is refused when the model loads (L92).
        compile: ``blocks``: the denoiser's blocks compiled, the declared shapes at
            the warm-up (L90); ``None``: eager.
        compile_cache: a folder that keeps the compiled artifacts across restarts.
        quantization: ``int8-weight``, ``int8-dynamic``, ``fp8`` (CUDA only) or
            ``gguf`` (with ``gguf_file``): the denoiser's weights quantized (L91);
            ``None``: as ``dtype`` says.
        quantize_components: the models quantized (``transformer,text_encoder_2``);
            ``None``: the denoisers.
        gguf_file: the denoiser's single-file GGUF checkpoint, with ``quantization``
            ``gguf``.
        devices: one runner per device (``parse_devices`` checked them); ``None``:
            one runner, where the model loads.
        step_seconds: the ``fake`` model's simulated compute per step.
        decode_tile_above: each ``DiffusersRunner``'s ``tile_above`` (L72).
        decode_framewise_above: each ``DiffusersRunner``'s ``framewise_above`` (L72).
        engine_config: the engine's configuration; its ``max_steps`` also caps the
            model's default step count.
        model_name: the id in ``/v1/models``.
        default_size: (width, height) when a request gives no size.
        default_steps: ``num_inference_steps`` when a request gives none.
        default_guidance_scale: ``guidance_scale`` when a request gives none.
        max_body_bytes: as ``ServeConfig``'s.
        retry_after_s: as ``ServeConfig``'s.
        max_priority: as ``ServeConfig``'s.
        upload_limits: how large an edit's upload may be.
        video_bytes: the most MP4 bytes held (``VideoConfig.max_bytes``).
        jobs_dir: the durable job store's folder (``VideoConfig.jobs_dir``, L77);
            ``None``: in memory.
        checkpoint_every_s: seconds between a running job's checkpoints
            (``VideoConfig.checkpoint_every_s``, L78).
        jobs_lease_s: share ``jobs_dir`` with the other servers on this host that share
            it (``VideoConfig.lease_s``, L79); ``None``: the folder is this server's.
        video_fps: frames per second of a video model's MP4s (``VideoConfig.fps``).
        video_jobs: the most video jobs held at once (``VideoConfig.max_jobs``).
        video_ttl_s: seconds a finished video job is kept (``VideoConfig.ttl_s``).
        parallel: ``(layout, ranks)`` (``"cfg"``, ``"ulysses"`` or ``"ring"``): one
            worker whose requests run over that many ranks (L48, L49); ``devices``
            are then the ranks' devices.
        split_by_load: with a token split in ``parallel``: choose the split per step
            by the batch (``ParallelRunner``'s ``by_load``).
        adapters: ``(name, file)`` pairs: adapters every runner loads at start (L88).
        adapter_dir: as ``ServeConfig``'s: where admin loads read from.
        allow_adapter_admin: as ``ServeConfig``'s: loads and unloads over HTTP.
        keys: the API keys the service accepts, their tenants and limits (L55,
            L56; ``Service``'s ``keys``); ``None``: an open server. Only digests
            travel: the keys themselves are never kept.
        warm_up: as ``ServeConfig``'s: one request before the service answers.
        warm_up_sizes: as ``ServeConfig``'s: the sizes the warm-up runs.
        result_cache: the engine's result cache (``EngineConfig.result_cache``, L95,
            L96); ``None``: ``engine_config``'s.
        jobs_db: a PostgreSQL connection string (``postgresql://...``): the video jobs'
            durable store (L98) instead of ``jobs_dir``; shared with the other servers
            on it with ``jobs_lease_s``.
        outputs: as ``ServeConfig``'s: the output store behind ``response_format``
            ``url`` (L97).
        trace_prompts: a request's span holds its prompt (L99; traces are on when the
            ``OTEL_*`` variables say so).
    """

    model: str
    revision: str | None = None
    variant: str | None = None
    dtype: str = "auto"
    attention_backend: str | None = None
    compile: str | None = None
    compile_cache: str | None = None
    quantization: str | None = None
    quantize_components: tuple[str, ...] | None = None
    gguf_file: str | None = None
    devices: tuple[str, ...] | None = None
    step_seconds: float = 0.05
    # DiffusersRunner's own defaults: importing it here would import torch.
    decode_tile_above: int | None = 1024 * 1024
    decode_framewise_above: int | None = None
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    model_name: str | None = None
    default_size: tuple[int, int] | None = None
    default_steps: int | None = None
    default_guidance_scale: float | None = None
    max_body_bytes: int = _SERVE.max_body_bytes
    retry_after_s: int = _SERVE.retry_after_s
    max_priority: int = _SERVE.max_priority
    upload_limits: UploadLimits = field(default_factory=UploadLimits)
    video_bytes: int | None = _VIDEO.max_bytes
    jobs_dir: str | None = None
    checkpoint_every_s: float | None = _VIDEO.checkpoint_every_s
    jobs_lease_s: float | None = None
    video_fps: float | None = None
    video_jobs: int = _VIDEO.max_jobs
    video_ttl_s: float = _VIDEO.ttl_s
    parallel: tuple[str, int] | None = None
    split_by_load: bool = False
    adapters: tuple[tuple[str, str], ...] = ()
    adapter_dir: str | None = None
    allow_adapter_admin: bool = False
    keys: ApiKeys | None = None
    warm_up: bool = False
    warm_up_sizes: tuple[tuple[int, int], ...] = ()
    result_cache: ResultCache | None = None
    jobs_db: str | None = None
    outputs: OutputConfig | None = None
    trace_prompts: bool = False

    def with_serve_config(self, config: ServeConfig) -> ServiceOptions:
        """These options with every setting of ``config``: its defaults, not the model's."""
        return dataclasses.replace(
            self,
            model_name=config.model_name,
            default_size=(config.default_width, config.default_height),
            default_steps=config.default_steps,
            default_guidance_scale=config.default_guidance_scale,
            max_body_bytes=config.max_body_bytes,
            retry_after_s=config.retry_after_s,
            max_priority=config.max_priority,
            adapter_dir=config.adapter_dir,
            allow_adapter_admin=config.allow_adapter_admin,
            warm_up=config.warm_up,
            warm_up_sizes=config.warm_up_sizes,
            outputs=config.outputs,
        )

    def load_model(self) -> LoadedModel:
        """Load the model these options name, on their devices, with their decode chunks.

        Raises:
            ValueError: ``model`` names no model.
            ModelError: the model does not load, or not on a device.
        """
        runner_options: dict[str, Any] = {
            "tile_above": self.decode_tile_above,
            "framewise_above": self.decode_framewise_above,
        }
        from ..runners import ModelSpec

        return load_model(
            ModelSpec(**{name: getattr(self, carried) for name, carried in SPEC_FIELDS.items()}),
            step_seconds=self.step_seconds,
            max_steps=self.engine_config.max_steps,
            devices=self.devices,
            runner_options=runner_options,
            parallel=self.parallel,
            by_load=self.split_by_load,
        )


def spec_options(spec: ModelSpec) -> dict[str, Any]:
    """The fields of ``ServiceOptions`` that carry ``spec`` (L89), by name (``SPEC_FIELDS``).

    Raises:
        ValueError: ``spec`` gives a field ``ServiceOptions`` does not carry a value
            other than its default (``component_dtypes``, ``offline``); the message
            names it.
    """
    for spec_field in dataclasses.fields(spec):
        name = spec_field.name
        if name not in SPEC_FIELDS and getattr(spec, name) != spec_field.default:
            why = _NOT_CARRIED.get(name, "a served model's options do not carry it")
            raise ValueError(f"{name}: not served: {why}")
    return {carried: getattr(spec, name) for name, carried in SPEC_FIELDS.items()}


def build_service(options: ServiceOptions, *, model: LoadedModel | None = None) -> Service:
    """Load the model ``options`` name and build its service, the defaults checked against it.

    Args:
        options: what to serve, and how.
        model: the model, if it is loaded already (``options.load_model()``).

    Returns:
        The service; its engine opens with its app's lifespan.

    Raises:
        ValueError: ``options.model`` names no model, or a setting is out of range
            (the message names the field of the configuration that refused it).
        OptionError: a default the model refuses, or an adapter it does not take;
            ``option`` names the field.
        ModelError: the model does not load, or not on a device.
    """
    loaded = model if model is not None else options.load_model()
    config = _serve_config(options, loaded)
    _load_adapters(options.adapters, loaded)
    videos = _video_config(options, loaded)
    engine_config = options.engine_config
    if options.result_cache is not None:
        engine_config = dataclasses.replace(engine_config, result_cache=options.result_cache)
    _check_defaults(engine_config, config, videos, loaded)
    runners = loaded.runners[0] if len(loaded.runners) == 1 else list(loaded.runners)
    return Service(
        runners,
        engine_config=engine_config,
        config=config,
        upload_limits=options.upload_limits,
        video_config=videos,
        keys=options.keys,
        tracing=Tracing.from_environment(prompts=options.trace_prompts),
    )


def _video_config(options: ServiceOptions, model: LoadedModel) -> VideoConfig:
    """The video jobs' configuration: in PostgreSQL (``jobs_db``), a folder, or memory."""
    fps = options.video_fps if options.video_fps is not None else model.fps or FALLBACK_FPS
    durable = options.jobs_db is not None or options.jobs_dir is not None
    return VideoConfig(
        fps=fps,
        max_jobs=options.video_jobs,
        ttl_s=options.video_ttl_s,
        max_bytes=options.video_bytes,
        jobs_dir=options.jobs_dir if options.jobs_db is None else None,
        store=None if options.jobs_db is None else _postgres(options.jobs_db),
        checkpoint_every_s=options.checkpoint_every_s,
        lease_s=options.jobs_lease_s if durable else None,
    )


def _serve_config(options: ServiceOptions, model: LoadedModel) -> ServeConfig:
    """The HTTP layer's configuration: the options', and the model's where they leave it."""
    width, height = options.default_size if options.default_size is not None else model.size
    steps = options.default_steps
    guidance = options.default_guidance_scale
    return ServeConfig(
        model_name=options.model_name if options.model_name is not None else model.name,
        default_width=width,
        default_height=height,
        default_steps=(
            steps if steps is not None else min(model.steps, options.engine_config.max_steps)
        ),
        default_guidance_scale=guidance if guidance is not None else model.guidance_scale,
        max_body_bytes=options.max_body_bytes,
        retry_after_s=options.retry_after_s,
        max_priority=options.max_priority,
        adapter_dir=options.adapter_dir,
        allow_adapter_admin=options.allow_adapter_admin,
        warm_up=options.warm_up,
        warm_up_sizes=options.warm_up_sizes,
        outputs=options.outputs,
    )


def _postgres(dsn: str) -> Callable[[str | None], JobStore]:
    """``postgres_store(dsn)``.

    Raises:
        OptionError: psycopg is not installed (``option``: ``jobs_db``).
    """
    try:
        return postgres_store(dsn)
    except ImportError as exc:
        raise OptionError("jobs_db", str(exc)) from None


def _load_adapters(adapters: tuple[tuple[str, str], ...], model: LoadedModel) -> None:
    """Load the adapters of ``ServiceOptions.adapters`` into every runner (L88).

    Raises:
        OptionError: the model takes no adapters, or refuses one (``option``: ``adapters``).
    """
    for name, path in adapters:
        for runner in model.runners:
            if not runner.capabilities.max_adapters:
                raise OptionError("adapters", f"{name}: this model takes no adapters")
            try:
                cast("AdapterRunner[Any]", runner).load_adapter(name, path)
            except (AdapterError, InvalidRequestError) as exc:
                raise OptionError("adapters", str(exc)) from None


def _check_defaults(
    engine_config: EngineConfig, config: ServeConfig, videos: VideoConfig, model: LoadedModel
) -> None:
    """Check the defaults once, as a request that uses them all (a video's default length too).

    Raises:
        OptionError: the engine or the model refuses one; ``option`` names its field.
    """
    capabilities = model.runners[0].capabilities
    frames = default_frames(videos.fps, videos.default_seconds, capabilities.frames)
    defaults = with_defaults({}, config, num_frames=frames)
    try:
        probe = GenerationRequest(prompt="-", cache=engine_config.default_cache, **defaults)
        engine_config.check_request(probe)
        # The size is within the engine's limits: the probe is now the warm-up's request
        # with every default, made as the model needs it (with an image of that size for
        # an image-to-video model, L69, which refuses a request without one).
        probe = dataclasses.replace(
            warm_up_request(capabilities, config), cache=probe.cache, **defaults
        )
        capabilities.check_request(probe)
    except InvalidRequestError as exc:
        option = _DEFAULT_FIELDS.get(exc.field, "default_size")
        raise OptionError(option, f"the model refuses it: {exc}") from None
