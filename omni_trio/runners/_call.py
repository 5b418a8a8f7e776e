"""PipelineCallRunner: any diffusers pipeline, run through its own ``__call__``.

The fallback for pipelines that ``DiffusersRunner`` cannot drive step by step.
The pipeline keeps its loop; its ``callback_on_step_end`` is the engine's step
boundary: the engine checks the request's token there and raises ``StopRun``,
which stops the loop before any decode (never the private ``_interrupt`` flag,
which keeps looping and still decodes). One request at a time, no batching.

The pipeline's own progress bar is off during the runner's calls (the engine's
step events report progress) and the caller's setting is back after each call.

One live runner at a time calls a pipeline: a second over the same pipeline is refused
by name (L42). Two workers would run its loop at once over one scheduler and one set
of modules, and making one wait for the other's whole call would hold its abort for
that long.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._request import GenerationRequest
from .._runner import Runner, RunnerCapabilities, StepCallback
from ._diffusers import DiffusersRunner
from ._preview import latent_preview
from ._registry import is_supported

__all__ = ["PipelineCallRunner", "runner_for"]

# The __call__ arguments the runner sets from the request; every other parameter
# of the pipeline's __call__ may be passed through GenerationRequest.extra.
_MANAGED = frozenset(
    {
        "self",
        "prompt",
        "negative_prompt",
        "num_inference_steps",
        "height",
        "width",
        "guidance_scale",
        "num_images_per_prompt",
        "batch_size",
        "generator",
        "output_type",
        "return_dict",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "callback",
        "callback_steps",
        "kwargs",
    }
)


#: The live runner of each pipeline (L42: one at a time), dropped with the pipeline.
_callers: weakref.WeakKeyDictionary[Any, weakref.ref[PipelineCallRunner]] = (
    weakref.WeakKeyDictionary()
)
_callers_lock = threading.Lock()


def _hold(pipeline: Any, runner: PipelineCallRunner) -> None:
    """Make ``runner`` the pipeline's caller; refuse it while another lives."""
    with _callers_lock:
        try:
            held = _callers.get(pipeline)
        except TypeError:
            return  # a pipeline that cannot be weakly held: nothing to check
        other = None if held is None else held()
        if other is not None and not other.closed:
            raise ValueError(
                "PipelineCallRunner: another live runner calls this pipeline (L42): two"
                " workers would run its loop at once; give each worker its own pipeline,"
                " or close the first runner"
            )
        _callers[pipeline] = weakref.ref(runner)


@dataclass(eq=False)
class CallState:
    """One request in a ``PipelineCallRunner``.

    ``total_steps`` is the number of steps the pipeline's loop runs, as the
    pipeline itself counts them (its ``num_timesteps``), known from the first step
    callback on; ``None`` before it or where the pipeline does not say. It differs
    from ``num_inference_steps`` where the pipeline skips part of its schedule:
    img2img and inpainting pipelines with ``strength`` below 1 run about
    ``num_inference_steps * strength`` of them (Stable Diffusion's img2img
    ``int(num_inference_steps * strength)``).
    """

    request_id: str
    kwargs: dict[str, Any]
    latents: torch.Tensor | None = None
    images: torch.Tensor | None = None
    total_steps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


_UNSET = object()


@contextmanager
def _progress_bar_off(pipeline: Any) -> Iterator[None]:
    """Disable the pipeline's progress bar inside the block; restore the caller's config.

    diffusers keeps the bar's settings in ``_progress_bar_config``, which
    ``set_progress_bar_config`` replaces and the bar creates when it is missing;
    the block puts back exactly what was there, or nothing.
    """
    if not callable(getattr(pipeline, "set_progress_bar_config", None)):
        yield
        return
    saved = getattr(pipeline, "_progress_bar_config", _UNSET)
    settings = dict(saved) if isinstance(saved, dict) else {}
    pipeline.set_progress_bar_config(**{**settings, "disable": True})
    try:
        yield
    finally:
        if saved is _UNSET:
            del pipeline._progress_bar_config
        else:
            pipeline._progress_bar_config = saved


def _as_images(images: Any) -> torch.Tensor:
    """Pipeline output (tensor, array or PIL list) as a float tensor ``[N, C, H, W]`` in [0, 1]."""
    if isinstance(images, torch.Tensor):
        return images.float()
    if isinstance(images, list):
        images = np.stack([np.asarray(image, dtype=np.float32) / 255.0 for image in images])
    array = np.asarray(images, dtype=np.float32)
    if array.ndim == 3:
        array = array[..., None]
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


class PipelineCallRunner:
    """Run any diffusers pipeline through its own ``__call__``, one request at a time.

    Steps are observed through ``callback_on_step_end`` where the pipeline has it;
    an abort then lands at the next step with no decode. A pipeline without it can
    only be aborted before its call starts. The engine counts a step per callback,
    so ``metrics.steps_done`` is the number of steps the pipeline ran (with
    ``strength`` < 1, fewer than ``num_steps``; ``CallState.total_steps`` says how
    many it runs). The pipeline's progress bar is off during each call.

    Args:
        pipeline: any diffusers pipeline.
        size_multiple: what height and width must be multiples of (default: the
            pipeline's ``vae_scale_factor``, else 8).

    Counters (any thread): ``live_states``, ``calls``, ``completed_calls``.

    Raises:
        ValueError: another live ``PipelineCallRunner`` calls ``pipeline`` (L42);
            closing it, or dropping it, lets the pipeline go.
    """

    def __init__(self, pipeline: Any, *, size_multiple: int | None = None) -> None:
        self.closed = False
        _hold(pipeline, self)
        self._pipeline = pipeline
        parameters = inspect.signature(pipeline.__call__).parameters
        self._parameters = frozenset(parameters)
        self._stepwise = "callback_on_step_end" in parameters
        multiple = size_multiple or int(getattr(pipeline, "vae_scale_factor", 8) or 8)
        self._capabilities = RunnerCapabilities(
            max_batch_size=1,
            batch_key_fields=(),
            previews=self._stepwise,
            size_multiple=multiple,
            extra_keys=self._parameters - _MANAGED,
            negative_prompt="negative_prompt" in parameters,
            whole_call=True,
        )
        self._lock = threading.Lock()
        self.live_states = 0
        self.calls = 0
        self.completed_calls = 0

    @property
    def capabilities(self) -> RunnerCapabilities:
        """One request at a time; previews when the pipeline reports its steps."""
        return self._capabilities

    def _count(self, name: str, amount: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def prepare(self, request: GenerationRequest, request_id: str) -> CallState:
        """Turn the request into ``__call__`` arguments the pipeline accepts."""
        seed = request.seed if request.seed is not None else int(torch.seed() % 2**63)
        wanted: dict[str, Any] = {
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_inference_steps": request.num_steps,
            "height": request.height,
            "width": request.width,
            "guidance_scale": request.guidance_scale,
            "num_images_per_prompt": request.num_images,
            "batch_size": request.num_images,
            "generator": torch.Generator().manual_seed(seed),
            "output_type": "pt",
        }
        kwargs = {
            key: value
            for key, value in wanted.items()
            if key in self._parameters and not (key == "negative_prompt" and value is None)
        }
        kwargs.update(request.extra)
        self._count("live_states", 1)
        return CallState(request_id, kwargs)

    def run(self, state: CallState, on_step: StepCallback) -> None:
        """Call the pipeline; ``on_step`` runs at every step (it raises to stop)."""
        kwargs = dict(state.kwargs)
        if self._stepwise:

            def callback(
                pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]
            ) -> dict[str, Any]:
                if state.total_steps is None:
                    # Set by the pipeline before its loop, after strength cut the schedule.
                    total = getattr(pipe, "num_timesteps", None)
                    state.total_steps = total if isinstance(total, int) else None
                state.latents = tensors.get("latents")
                on_step(state.total_steps)
                return tensors

            kwargs["callback_on_step_end"] = callback
            kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
        self._count("calls", 1)
        with torch.no_grad(), _progress_bar_off(self._pipeline):
            output = self._pipeline(**kwargs)
        state.images = _as_images(output.images)
        state.latents = None
        self._count("completed_calls", 1)

    def step(self, states: Any) -> None:
        """Never called: a whole-call runner runs its own loop."""
        raise NotImplementedError("PipelineCallRunner runs whole calls")

    def preview(self, state: CallState) -> torch.Tensor | None:
        """Project the latents of the last step to RGB (four-dimensional latents only)."""
        if state.latents is None or state.latents.ndim != 4:
            return None
        return latent_preview(state.latents)

    def decode(self, state: CallState) -> torch.Tensor:
        """The images the pipeline's own call decoded."""
        assert state.images is not None
        return state.images

    def discard(self, state: CallState) -> None:
        """Drop the state's tensors."""
        state.latents = None
        state.images = None
        state.kwargs = {}
        self._count("live_states", -1)

    def close(self) -> None:
        """Let the pipeline go (another runner may call it); it belongs to the caller."""
        self.closed = True


def runner_for(pipeline: Any, **kwargs: Any) -> Runner[Any]:
    """A step-by-step ``DiffusersRunner`` where the family is supported, else the fallback."""
    if is_supported(pipeline):
        return DiffusersRunner(pipeline, **kwargs)
    return PipelineCallRunner(pipeline)
