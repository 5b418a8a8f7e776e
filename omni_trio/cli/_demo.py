"""``omni-trio demo``: generate one image end to end, with a progress bar.

The report goes to ``out`` (stdout), the progress bar to stderr. Arguments the
demo cannot use (a size or step count the model refuses, a ``--model`` that is neither
a diffusers folder nor a hub id in reach, a model spec's value the spec refuses, an
``--out`` that cannot be written) raise ``UsageError``, checked before the model loads
where the model is not needed to tell; a model that does not load or a request that
fails raises ``CommandError``.

``--model`` is a model spec (L89) as ``serve``'s: a folder or a Hugging Face hub id
(from the cache with ``HF_HUB_OFFLINE=1``) with the spec's options (``_spec_table``,
the same declarations as ``serve``'s), loaded by ``omni_trio.runners``' own
``load_pipeline_of`` and ``runner_of``; the spec's options apply with ``--model`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio

# tqdm ships no type hints; its bar is used through a handful of calls.
from tqdm import tqdm  # type: ignore[import-untyped]

from .._config import EngineConfig
from .._errors import InvalidRequestError, RequestAbortedError, RequestFailedError
from .._open import open_engine
from .._outputs import RequestMetrics
from .._request import GenerationRequest
from .._runner import Runner, RunnerCapabilities
from ._declare import add_options
from ._errors import CommandError, UsageError, summary
from ._given import Unused, refuse_unused
from ._spec_table import SPEC_OPTIONS, named, spec_error
from ._types import count, seconds

if TYPE_CHECKING:
    from ..runners import ModelSpec

__all__ = ["KINDS", "add_demo_arguments", "run_demo"]

KINDS = ("sd", "sdxl", "sd3", "flux", "qwen-image", "unet", "fake")

DEFAULT_SIZE = 64
"""Image side when ``--size`` is not given and the model makes any size."""

# The option that sets each request field, to name it in an error.
_OPTIONS = {
    "prompt": "--prompt",
    "num_steps": "--steps",
    "height": "--size",
    "width": "--size",
    "seed": "--seed",
    "image": "--image",
    "strength": "--strength",
}

#: The model spec's options (``serve``'s), the compilation's help saying what it costs here.
DEMO_SPEC_OPTIONS = tuple(
    option
    if option.flag != "--compile"
    else dataclasses.replace(
        option,
        help="blocks: compile the denoiser's blocks; the demo's one request compiles them"
        " on its first step, which takes 10-120 s on a CPU (default: eager)",
    )
    for option in SPEC_OPTIONS
)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument(
        "--kind",
        choices=KINDS,
        default="sd",
        help="tiny model to build (default sd); 'fake' needs no diffusers at all",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="ID_OR_FOLDER",
        help="a local diffusers folder or a Hugging Face hub id (org/name; from the cache"
        " with HF_HUB_OFFLINE=1) instead, with the model options below",
    )
    parser.add_argument("--prompt", default="a red flower in a blue vase")
    parser.add_argument("--steps", type=int, default=20, help="denoise steps (default 20)")
    parser.add_argument(
        "--size",
        type=int,
        default=None,
        help=f"image side in pixels (default {DEFAULT_SIZE}; unet: 32)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--image",
        default=None,
        metavar="PATH",
        help="start from this image (image-to-image; sd and sdxl), resized to --size",
    )
    parser.add_argument(
        "--strength",
        type=float,
        default=None,
        metavar="S",
        help="with --image: how much of the schedule runs, in (0, 1] (default 0.8)",
    )
    parser.add_argument(
        "--out", default="demo.png", help="where to write the image (default demo.png)"
    )
    parser.add_argument(
        "--abort-after",
        type=count(1),
        default=None,
        metavar="K",
        help="abort after step K, to show the abort landing at the next step with no decode",
    )
    parser.add_argument(
        "--step-seconds",
        type=seconds,
        default=0.05,
        help="simulated compute per step of the fake model (default 0.05)",
    )
    parser.add_argument(
        "--torch-threads",
        type=count(1, 4096),
        default=None,
        metavar="N",
        help="torch's intra-op threads (default: torch's own)",
    )
    parser.add_argument(
        "--backend", choices=["trio", "asyncio"], default="trio", help="event loop (default trio)"
    )
    add_options(parser, DEMO_SPEC_OPTIONS, None)


def _unused(args: argparse.Namespace) -> list[Unused]:
    """The options this run leaves without effect."""
    if args.model is not None:
        reason = "does not apply with --model (the folder's pipeline is the model)"
        return [
            Unused(dest="kind", option="--kind", reason=reason),
            Unused(dest="step_seconds", option="--step-seconds", reason=reason),
        ]
    unused = [
        Unused(dest=option.name, option=option.flag, reason="applies with --model only")
        for option in DEMO_SPEC_OPTIONS
    ]
    if args.kind != "fake":
        reason = "applies to --kind fake only"
        unused.append(Unused(dest="step_seconds", option="--step-seconds", reason=reason))
    return unused


def _config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration: its default limits, and ``--torch-threads``."""
    return EngineConfig(torch_threads=args.torch_threads)


def _request(
    args: argparse.Namespace, capabilities: RunnerCapabilities | None
) -> GenerationRequest:
    """The request ``args`` ask for, checked against the engine's limits and the runner's.

    Raises:
        UsageError: a value is refused; the message names its option.
    """
    fixed = capabilities.fixed_size if capabilities is not None else None
    size = args.size if args.size is not None else fixed[0] if fixed else DEFAULT_SIZE
    try:
        request = GenerationRequest(
            prompt=args.prompt,
            num_steps=args.steps,
            height=size,
            width=size,
            seed=args.seed,
            image=_image(args.image, size),
            strength=args.strength,
        )
        _config(args).check_request(request)
        if capabilities is not None:
            capabilities.check_request(request)
    except InvalidRequestError as exc:
        option = _OPTIONS.get(exc.field, exc.field)
        raise UsageError(f"{option}: {str(exc).removeprefix(f'{exc.field}: ')}") from exc
    if args.abort_after is not None and args.abort_after >= request.denoise_steps:
        raise UsageError(
            f"--abort-after: must be below the {request.denoise_steps} denoise steps:"
            f" the run ends before step {args.abort_after}"
        )
    return request


def _image(path: str | None, size: int) -> Any:
    """The ``--image`` file as an RGB image of ``size`` x ``size``, or ``None``.

    Raises:
        UsageError: it cannot be read as an image.
    """
    if path is None:
        return None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB").resize((size, size), Image.Resampling.LANCZOS)
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise UsageError(f"--image: cannot read {path!r} as an image ({exc})") from exc


def _check_out(path: str) -> None:
    """Check that an image can be written to ``path``, before the model loads and generates.

    Raises:
        UsageError: its extension names no format PIL writes, or the file cannot be
            written (no such folder, a folder, no permission).
    """
    from PIL import Image

    extension = os.path.splitext(path)[1].lower()
    if Image.registered_extensions().get(extension) not in Image.SAVE:
        raise UsageError(f"--out: {path!r} does not end with an image extension (.png, .jpg, ...)")
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise UsageError(f"--out: cannot write {path!r}: {exc.strerror}") from None
    if not existed:
        os.unlink(path)  # only the check made it


def _model_spec(args: argparse.Namespace) -> tuple[ModelSpec, Path] | None:
    """The model spec of ``--model`` and its options, checked, and its folder (a hub id's
    in the Hugging Face cache, fetched unless offline); nothing loads.

    Raises:
        UsageError: the spec refuses a value (named by its option), or ``--model`` is
            neither a diffusers folder nor a hub id in reach.
    """
    if args.model is None:
        return None
    from ..runners import ModelSpec
    from ..runners._spec import pipeline_folder

    given = {option.name: getattr(args, option.name) for option in DEMO_SPEC_OPTIONS}
    try:
        spec = ModelSpec(
            source=args.model, **{name: value for name, value in given.items() if value is not None}
        )
        return spec, pipeline_folder(spec)
    except ValueError as exc:
        raise spec_error(exc) from None


def _runner(
    args: argparse.Namespace, model: tuple[ModelSpec, Path] | None
) -> tuple[Runner[Any], str]:
    if model is not None:
        from ..runners._spec import load_pipeline_of, runner_of

        spec, folder = model
        try:
            pipeline = load_pipeline_of(spec, folder=folder)
            runner: Runner[Any] = runner_of(pipeline, spec)
        except Exception as exc:
            # A setting this machine or model does not take names its option.
            setting = named(exc) if isinstance(exc, ValueError) else None
            raise CommandError(
                setting
                or f"--model: could not load a pipeline from {spec.source!r}: {summary(exc)}"
            ) from exc
        shown = [f"{type(pipeline).__name__} from {spec.source}"]
        shown += [value for value in (spec.dtype, spec.quantization) if value not in ("auto", None)]
        shown += ["compiled blocks"] if spec.compile is not None else []
        return runner, ", ".join(shown)
    if args.kind == "fake":
        from ..testing import FakeRunner

        return FakeRunner(step_seconds=args.step_seconds), "FakeRunner (no weights)"
    from ..runners import DiffusersRunner, tiny_pipeline

    pipeline = tiny_pipeline(args.kind, seed=0)
    return DiffusersRunner(pipeline), f"tiny {type(pipeline).__name__}, random weights"


def _print_metrics(metrics: RequestMetrics, out: TextIO) -> None:
    out.write(f"  queue wait     {metrics.queue_wait_s * 1e3:9.2f} ms\n")
    out.write(f"  execution      {metrics.exec_s * 1e3:9.2f} ms\n")
    out.write(f"  output ready   {metrics.output_ready_wait_s * 1e3:9.2f} ms\n")
    for stage, spent in metrics.stage_durations.items():
        out.write(f"    {stage:<12} {spent * 1e3:9.2f} ms\n")
    out.write(f"  steps done     {metrics.steps_done:9d}\n")
    out.write(f"  total          {metrics.total_s * 1e3:9.2f} ms\n")
    if metrics.abort_latency_s is not None:
        out.write(f"  abort latency  {metrics.abort_latency_s * 1e3:9.2f} ms\n")


async def _demo(
    args: argparse.Namespace, runner: Runner[Any], request: GenerationRequest, out: TextIO
) -> int:
    async with open_engine(runner, _config(args)) as engine:
        async with engine.submit(request, request_id="demo") as handle:
            aborted_at = None
            # tqdm draws on stderr: it redraws in place on a terminal and keeps to
            # plain lines in a pipe or a log.
            with tqdm(
                total=request.denoise_steps, desc="  denoise", unit="step", file=sys.stderr
            ) as bar:
                async for event in handle:
                    if bar.total != event.total:
                        bar.total = event.total
                    bar.update(event.step - bar.n)
                    if args.abort_after is not None and event.step >= args.abort_after:
                        aborted_at = event.step
                        break
            if aborted_at is not None:
                out.write(f"  aborting after step {aborted_at}...\n")
                await handle.abort()
            try:
                output = await handle.result()
            except RequestAbortedError as exc:
                assert handle.metrics is not None
                out.write(f"  aborted ({exc.reason}) after step {handle.metrics.steps_done}; ")
                out.write(f"decodes run: {getattr(runner, 'decodes', 0)}\n")
                _print_metrics(handle.metrics, out)
                return 0
            except RequestFailedError as exc:
                # str() of the engine's error is safe and bounded; the cause's own
                # text is the runner's code and may be neither.
                raise CommandError(f"the model failed: {exc}") from exc
        output.to_pil()[0].save(args.out)
        out.write(f"  wrote {args.out} ({output.images.shape[-1]}x{output.images.shape[-2]})\n")
        _print_metrics(output.metrics, out)
    return 0


def run_demo(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the demo with parsed ``args``; return the exit status.

    Args:
        args: the namespace ``add_demo_arguments``'s options parsed into.
        out: where the report goes.

    Returns:
        0: the image was written, or the abort that ``--abort-after`` asked for landed.

    Raises:
        UsageError: an argument the demo cannot use (checked before the model loads,
            but for one the model refuses).
        CommandError: the model did not load or the request failed.
    """
    refuse_unused(args, _unused(args), from_environment=())
    _request(args, None)  # refuses a bad step count or size before the model loads
    _check_out(args.out)
    model = _model_spec(args)
    runner, description = _runner(args, model)
    request = _request(args, runner.capabilities)
    out.write(
        f"omni_trio demo: {request.denoise_steps} steps at {request.width}x{request.height},"
        f" seed {request.seed}\n"
    )
    out.write(f"  model: {description}\n")
    out.flush()
    result: int = anyio.run(_demo, args, runner, request, out, backend=args.backend)
    return result
