"""``serve``'s options as the serve package's ``ServiceOptions``, and its errors as the command's.

``serve`` and ``serve --ray`` build their service as ``build_service`` does, from
the ``ServiceOptions`` of their arguments: each field that one option sets is that
option's value (``_serve_table`` says which), and a function here builds each of the
others from its options (``BUILT``: the devices, the ranks, the keys, the warm-up).
The serve package says what is wrong without naming an option (a ``ValueError`` for
a spec that names no model, a ``ModelError`` for one that does not load, an
``OptionError`` naming the field of a default the model refuses); here those become
the command's usage errors and errors, named by the option that set them.

Which options do not apply (``_given`` refuses them), from where the table says each
applies: ``unused_options`` from the arguments alone, before anything loads;
``unused_for_model`` once the model loaded, from what it is (a video model, its
family).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._results import ResultCache
from ..serve._config import OutputConfig
from ..serve._keys import ApiKeys, load_keys_file
from ..serve._models import MODELS, LoadedModel, ModelError, is_hub_id, model_folder
from ..serve._options import OptionError, ServiceOptions, build_service
from ._declare import Option, field_values
from ._errors import CommandError, UsageError, summary
from ._given import Unused
from ._serve_table import SERVE_OPTIONS, SPLIT_BY_LOAD, Applies
from ._spec_table import named

if TYPE_CHECKING:
    from ..serve._app import Service

__all__ = [
    "BUILT",
    "check_model",
    "load",
    "make_service",
    "option_setting",
    "service_options",
    "unused_for_model",
    "unused_options",
]


def option_setting(field: str) -> Option:
    """The option that sets ``field`` of ``ServiceOptions`` (``default_cache``: the
    engine configuration's, ``--cache``), to name it in an error."""
    [option] = [o for o in SERVE_OPTIONS if any(f.split(".")[-1] == field for f in o.fields)]
    return option


#: Each rank option's layout (``ParallelRunner``'s keyword).
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
    if spec in MODELS or is_hub_id(spec):
        return  # a hub id is looked up when it loads (offline: in the cache only)
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
        values = field_values(args, SERVE_OPTIONS, ServiceOptions, built=BUILT)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.allow_adapter_admin and args.adapter_dir is None:
        raise UsageError("--allow-adapter-admin: needs --adapter-dir, the folder loads read from")
    # In BUILT's order: the first wrong one is the one named.
    values.update({name: build(args) for name, build in BUILT.items()})
    return ServiceOptions(**values)


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


def _warm_up(args: argparse.Namespace) -> bool:
    """``--no-warm-up`` not given, and a real model (the fake one needs no warm-up)."""
    return bool(args.warm_up) and args.model != "fake"


def _result_cache(args: argparse.Namespace) -> ResultCache | None:
    """``--result-cache BYTES[:DIR]`` with its ``--result-cache-scope``.

    Raises:
        UsageError: the cache refuses them (the message names the option).
    """
    if args.result_cache is None:
        return None
    max_bytes, folder = args.result_cache
    try:
        return ResultCache(max_bytes=max_bytes, folder=folder, scope=args.result_cache_scope)
    except ValueError as exc:
        raise UsageError(f"--result-cache: {exc}") from None


def _outputs(args: argparse.Namespace) -> OutputConfig | None:
    """The output store of ``--output-store`` and its TTL, secret and public URL.

    Raises:
        UsageError: the secret's file cannot be read, or the store refuses a setting,
            or one of them is given without ``--output-store``.
    """
    if args.output_store is None:
        for flag in ("--output-secret-file", "--output-url"):
            if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
                raise UsageError(f"{flag}: needs --output-store")
        return None
    secret = None
    if args.output_secret_file is not None:
        try:
            with open(args.output_secret_file, "rb") as file:
                secret = file.read().strip()
        except OSError as exc:
            raise UsageError(f"--output-secret-file: {summary(exc)}") from None
    try:
        return OutputConfig(
            store=args.output_store,
            ttl_s=args.output_ttl,
            secret=secret,
            public_url=args.output_url,
        )
    except ValueError as exc:
        field, _, detail = str(exc).partition(": ")
        option = _OUTPUT_FLAGS.get(field)
        raise UsageError(f"{option}: {detail}" if option else f"--output-store: {exc}") from None


#: The option that sets each field of ``OutputConfig`` a refusal may name.
_OUTPUT_FLAGS = {
    "store": "--output-store",
    "ttl_s": "--output-ttl",
    "secret": "--output-secret-file",
    "public_url": "--output-url",
}


#: The fields of ``ServiceOptions`` built from the options that set them (``sets``).
BUILT: dict[str, Callable[[argparse.Namespace], Any]] = {
    "devices": _devices,
    "parallel": _parallel,
    "keys": _keys,
    "warm_up": _warm_up,
    "result_cache": _result_cache,
    "outputs": _outputs,
}


def load(options: ServiceOptions) -> LoadedModel:
    """``options.load_model()``, its errors the command's.

    Raises:
        UsageError: ``--model`` names no model, or a setting it does not take.
        CommandError: the model does not load, or not on a device.
    """
    check_model(options.model)
    try:
        return options.load_model()
    except ValueError as exc:  # a setting the model does not take (--revision of a tiny one)
        raise UsageError(named(exc) or str(exc)) from None
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
        raise UsageError(f"{option_setting(exc.option).flag}: {exc.detail}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _unused(applies: Applies) -> list[Unused]:
    """The options that apply only where ``applies`` says, in the table's order."""
    return [
        Unused(dest=option.name, option=option.flag, reason=applies.value)
        for option in SERVE_OPTIONS
        if option.applies is applies
    ]


def unused_options(args: argparse.Namespace) -> list[Unused]:
    """The options ``serve``'s own arguments leave without effect (the model not loaded)."""
    fake = args.model == "fake"
    holds = {
        Applies.RAY: args.ray,
        Applies.NOT_RAY: not args.ray,
        Applies.FAKE: fake,
        Applies.REAL: not fake,
    }
    return [unused for applies, held in holds.items() if not held for unused in _unused(applies)]


def unused_for_model(model: LoadedModel) -> list[Unused]:
    """The options that ``model`` leaves without effect: what it is decides.

    A video model's options need a video model; the decode chunks (L72) need a
    ``DiffusersRunner`` (other runners decode as they like) with a VAE (the
    unconditional UNets have none), framewise decoding an LTX-Video one.
    """
    runner = model.runners[0]
    # DiffusersRunner.family; the fake model and a pipeline served by its own call have none.
    family = getattr(runner, "family", None)
    holds = {
        Applies.ADAPTERS: bool(runner.capabilities.max_adapters),
        Applies.VIDEO: runner.capabilities.frames is not None,
        Applies.VAE: family is not None and family != "unet",
        Applies.LTX: family == "ltx",
    }
    return [unused for applies, held in holds.items() if not held for unused in _unused(applies)]
