"""``serve``'s options as the serve package's ``ServiceOptions``, and its errors as the command's.

``serve`` and ``serve --ray`` build their service as ``build_service`` does, from
the ``ServiceOptions`` of their arguments. The serve package says what is wrong
without naming an option (a ``ValueError`` for a spec that names no model, a
``ModelError`` for one that does not load, an ``OptionError`` naming the field of
a default the model refuses); here those become the command's usage errors and
errors, named by the option that set them.

Which options do not apply (``_given`` refuses them): ``unused_options`` from the
arguments alone, before anything loads; ``unused_for_model`` once the model
loaded, from what it is (a video model, its family).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .._config import EngineConfig
from ..serve._keys import ApiKeys, load_keys_file
from ..serve._models import MODELS, LoadedModel, ModelError, model_folder
from ..serve._options import OptionError, ServiceOptions, build_service
from ..serve._upload import UploadLimits
from ._errors import CommandError, UsageError, summary
from ._given import Unused

if TYPE_CHECKING:
    from ..serve._app import Service

__all__ = [
    "PARALLEL_OPTIONS",
    "check_model",
    "load",
    "make_service",
    "service_options",
    "unused_for_model",
    "unused_options",
]

#: The option that sets each field of ``ServiceOptions`` the model can refuse.
_OPTIONS = {
    "video_fps": "--video-fps",
    "default_size": "--default-size",
    "default_steps": "--default-steps",
    "default_guidance_scale": "--default-guidance",
    "default_cache": "--cache",
    "adapters": "--adapter",
}


#: ``serve``'s options of one request over several ranks, and what each splits.
PARALLEL_OPTIONS = {
    "--cfg-parallel": "split each request's classifier-free guidance (its two halves)",
    "--ulysses": "split each model call's tokens, Ulysses attention (DiT models)",
    "--ring": "split each model call's tokens, ring attention (DiT models)",
}
#: The option that turns a token split off while the queue is deep (``by_load``).
SPLIT_BY_LOAD = "--split-by-load"
#: Each option's layout (``ParallelRunner``'s keyword).
_LAYOUTS = {"--cfg-parallel": "cfg", "--ulysses": "ulysses", "--ring": "ring"}


def _parallel(args: argparse.Namespace) -> tuple[str, int] | None:
    """``(layout, ranks)`` of the rank option given, if any (argparse lets one through).

    Raises:
        UsageError: it is given with ``--workers`` or with the fake model;
            ``--split-by-load`` is given without a token split.
    """
    by_load: bool = args.split_by_load
    for option, layout in _LAYOUTS.items():
        ranks: int | None = getattr(args, option.removeprefix("--").replace("-", "_"))
        if ranks is None:
            continue
        if args.workers is not None:
            raise UsageError(f"{option}: one worker over {ranks} ranks; leave --workers out")
        if args.model == "fake":
            raise UsageError(f"{option}: the fake model runs in one process; serve a real one")
        if by_load and layout == "cfg":
            raise UsageError(f"{SPLIT_BY_LOAD}: splits tokens by load; use --ulysses or --ring")
        return layout, ranks
    if by_load:
        raise UsageError(
            f"{SPLIT_BY_LOAD}: needs the token split it turns off: --ulysses or --ring"
        )
    return None


def check_model(spec: str) -> None:
    """Check that ``spec`` names a model (built in, or a diffusers folder); nothing loads.

    Raises:
        UsageError: it names none; the message names ``--model``.
    """
    if spec in MODELS:
        return
    try:
        model_folder(spec)
    except ValueError as exc:
        raise UsageError(f"--model: {exc}") from None


def _devices(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The devices ``--devices`` or ``--workers`` name; ``None`` when neither is given.

    Raises:
        UsageError: ``--devices`` names no device, a bad one, or one twice.
    """
    workers: int | None = args.workers
    if workers is not None:
        return ("cpu",) * workers
    if args.devices is None:
        return None
    from ..runners._devices import parse_devices

    try:
        return tuple(parse_devices(args.devices))
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None


def service_options(args: argparse.Namespace) -> ServiceOptions:
    """The ``ServiceOptions`` of ``serve``'s parsed arguments (the model is not checked).

    Raises:
        UsageError: ``--devices`` is wrong, a rank option does not apply, or a limit
            is out of the engine's range.
    """
    try:
        engine_config = EngineConfig(
            max_batch_size=args.max_batch_size,
            max_waiting=args.max_waiting,
            shutdown_grace=args.shutdown_grace,
            stop_timeout_s=args.stop_timeout,
            max_step_s=args.max_step_time,
            max_steps=args.max_steps,
            max_height=args.max_size,
            max_width=args.max_size,
            max_num_images=args.max_n,
            torch_threads=args.torch_threads,
            default_cache=args.cache,
        )
        uploads = UploadLimits(max_bytes=args.max_upload_bytes, max_pixels=args.max_upload_pixels)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.allow_adapter_admin and args.adapter_dir is None:
        raise UsageError("--allow-adapter-admin: needs --adapter-dir, the folder loads read from")
    return ServiceOptions(
        model=args.model,
        devices=_devices(args),
        step_seconds=args.step_seconds,
        decode_tile_above=args.decode_tile_above,
        decode_framewise_above=args.decode_framewise_above,
        engine_config=engine_config,
        model_name=args.model_name,
        default_size=args.default_size,
        default_steps=args.default_steps,
        default_guidance_scale=args.default_guidance,
        max_body_bytes=args.max_body_bytes,
        retry_after_s=args.retry_after,
        max_priority=args.max_priority,
        upload_limits=uploads,
        video_bytes=args.video_bytes,
        jobs_dir=args.jobs_dir,
        checkpoint_every_s=args.checkpoint_every,
        jobs_lease_s=args.jobs_lease,
        video_fps=args.video_fps,
        video_jobs=args.video_jobs,
        video_ttl_s=args.video_ttl,
        parallel=_parallel(args),
        split_by_load=args.split_by_load,
        adapters=tuple(args.adapter),
        adapter_dir=args.adapter_dir,
        allow_adapter_admin=args.allow_adapter_admin,
        keys=_keys(args),
        warm_up=args.warm_up and args.model != "fake",
    )


def _keys(args: argparse.Namespace) -> ApiKeys | None:
    """The keys of ``--api-key`` (``OMNI_TRIO_API_KEYS``), ``--keys-file`` and ``--metrics-auth``.

    Raises:
        UsageError: a keys file that cannot be read or is wrong, or
            ``--metrics-auth`` without any key.
    """
    given: list[str] = []
    # Each --api-key is a list (comma-separated); from the variable, one list.
    for value in args.api_keys or ():
        given += value if isinstance(value, list) else [value]
    keys = ApiKeys.from_keys(given, metrics_auth=args.metrics_auth)
    if args.keys_file is not None:
        try:
            keys = keys.merged(load_keys_file(args.keys_file))
        except ValueError as exc:
            raise UsageError(f"--keys-file: {exc}") from None
    if args.metrics_auth and not keys:
        raise UsageError("--metrics-auth: needs an API key (--api-key or --keys-file)")
    return keys if keys else None


def load(options: ServiceOptions) -> LoadedModel:
    """``options.load_model()``, its errors the command's.

    Raises:
        UsageError: ``--model`` names no model.
        CommandError: the model does not load, or not on a device.
    """
    check_model(options.model)
    try:
        return options.load_model()
    except ModelError as exc:
        reason = "" if exc.__cause__ is None else f": {summary(exc.__cause__)}"
        raise CommandError(f"--model: {exc}{reason}") from exc


def make_service(options: ServiceOptions, model: LoadedModel) -> Service:
    """``build_service(options, model=model)``, its errors the command's.

    Raises:
        UsageError: a setting is out of range, or a default the model refuses
            (the message names the option).
    """
    try:
        return build_service(options, model=model)
    except OptionError as exc:
        raise UsageError(f"{_OPTIONS[exc.option]}: {exc.detail}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


#: What an option that only ``--ray`` reads, or that ``--ray`` does not read, says.
_RAY_ONLY = "applies with --ray only"
_NOT_RAY = "does not apply with --ray (Ray Serve's proxy serves HTTP)"


def unused_options(args: argparse.Namespace) -> list[Unused]:
    """The options ``serve``'s own arguments leave without effect (the model not loaded)."""
    unused = []
    if args.ray:
        unused += [
            Unused(dest="server", option="--server", reason=_NOT_RAY),
            Unused(dest="close_timeout", option="--close-timeout", reason=_NOT_RAY),
            Unused(dest="access_log", option="--no-access-log", reason=_NOT_RAY),
        ]
    else:
        unused += [
            Unused(dest="replicas", option="--replicas", reason=_RAY_ONLY),
            Unused(dest="replica_gpus", option="--replica-gpus", reason=_RAY_ONLY),
            Unused(dest="ray_address", option="--ray-address", reason=_RAY_ONLY),
        ]
    if args.model != "fake":
        unused.append(
            Unused(
                dest="step_seconds", option="--step-seconds", reason="applies to --model fake only"
            )
        )
    else:
        fake = "applies to a real model (the fake one's step is --step-seconds)"
        unused.append(Unused(dest="warm_up", option="--no-warm-up", reason=fake))
    return unused


def unused_for_model(model: LoadedModel) -> list[Unused]:
    """The options that ``model`` leaves without effect: what it is decides.

    A video model's options need a video model; the decode chunks (L72) need a
    ``DiffusersRunner`` (other runners decode as they like) with a VAE (the
    unconditional UNets have none), framewise decoding an LTX-Video one.
    """
    runner = model.runners[0]
    unused = []
    if not runner.capabilities.max_adapters:
        takes = "applies to models that take adapters (diffusers pipelines with LoRA loading)"
        unused += [
            Unused(dest="adapter_dir", option="--adapter-dir", reason=takes),
            Unused(dest="allow_adapter_admin", option="--allow-adapter-admin", reason=takes),
        ]
    if runner.capabilities.frames is None:
        video = "applies to video models only (Wan, LTX-Video)"
        unused += [
            Unused(dest="video_bytes", option="--video-bytes", reason=video),
            Unused(dest="jobs_dir", option="--jobs-dir", reason=video),
            Unused(dest="checkpoint_every", option="--checkpoint-every", reason=video),
            Unused(dest="jobs_lease", option="--jobs-lease", reason=video),
            Unused(dest="video_fps", option="--video-fps", reason=video),
            Unused(dest="video_jobs", option="--video-jobs", reason=video),
            Unused(dest="video_ttl", option="--video-ttl", reason=video),
        ]
    # DiffusersRunner.family; the fake model and a pipeline served by its own call have none.
    family = getattr(runner, "family", None)
    if family is None or family == "unet":
        unused.append(
            Unused(
                dest="decode_tile_above",
                option="--decode-tile-above",
                reason="applies to models whose VAE omni_trio drives (not fake, an"
                " unconditional UNet or a pipeline served by its own call)",
            )
        )
    if family != "ltx":
        unused.append(
            Unused(
                dest="decode_framewise_above",
                option="--decode-framewise-above",
                reason="applies to LTX-Video models only",
            )
        )
    return unused
