"""The seam between the engine and a model: the Runner protocol.

A runner is a small set of synchronous calls that the engine makes from its own
threads only, never from the event loop. The engine owns the denoise loop:

- ``prepare(request, request_id)``: encode the prompt, make the initial latents and a
  per-request scheduler; return an opaque per-request state.
- ``step(states)``: run one denoise step for every state in the batch, in place.
  States may be at different steps when the runner declares ``can_join``.
- ``preview(state)``: a cheap CPU image of the current latents (``previews``).
- ``decode(state)``: the final images ``[N, C, H, W]`` in [0, 1], on any device (for a
  video request, the videos ``[N, F, C, H, W]``). Made from the engine's materializer
  thread, possibly while ``step`` runs for others.
- ``discard(state)``: the engine lets go of this state; free what it holds.
- ``close()``: the engine is done with the runner (last call, worker thread).
- ``run(state, on_step)``: only for runners that declare ``whole_call`` (they cannot
  step, so they run their own loop); ``on_step()`` must be called after every step
  and may raise ``StopRun``, which ``run`` must let through.
- ``state_bytes(state)``, ``suspend(state, to_host=...)``, ``resume(state)``: only
  for runners that declare ``suspendable`` (L61): the engine parks a running
  request at a step boundary and later resumes it from the step it reached.
- ``checkpoint(state)``, ``checkpoint_bytes(copy)``, ``restore(request, request_id,
  data)``: only for runners that declare ``checkpoints`` (L78): a copy of a running
  request's state at a step boundary, made bytes off the step loop, and a state
  rebuilt from those bytes (in a fresh process) that continues where it was.
- ``cache_metrics(state)`` and ``set_cache_threshold(state, threshold)``: only for
  runners that declare ``step_cache`` (L80-L84): what a request's step cache did, read
  before its ``discard``, and the engine loosening a request's threshold at a step
  boundary when its deadline is at risk.
- ``prompt_cache_metrics(state)``: optional, for a runner with a prompt-embedding
  cache (L94): what it did for the request's texts (a ``PromptCacheMetrics``, or
  ``None``), read before its ``discard`` as ``cache_metrics`` is, whatever ended the
  request. Without it, ``RequestMetrics.prompt_cache`` is ``None``.
- ``load_adapter``, ``unload_adapter``, ``adapters()``, ``adapter_names()``: only for
  runners that declare ``max_adapters`` (L85-L87), and callable from any thread.
- ``result_fingerprint()``: optional, for an engine with a result cache (L95): a str
  that names the model the runner's outputs come from, different whenever the same
  request could make other pixels (other weights, dtype or kind of device), constant
  while it serves; called once, when the engine opens. Without it, ``open_engine``
  refuses a result cache.
- ``trajectory(state)``: only for runners that declare ``samplers`` (L100): the
  trajectory of a request with ``return_trajectory``, read after its ``decode`` and
  before its ``discard`` (materializer thread).
- ``cancel_point()`` (a function, not a method): a runner that declares
  ``cancel_points`` calls it at every point inside ``step`` (between transformer
  blocks) and ``decode`` (between chunks) where the call may be left (L71, L72).
  There the engine may raise ``StopRun``: the runner lets it through and leaves its
  model as clean as a fresh one (no half-applied state, per-call caches cleared);
  the states of that call are discarded, never stepped or decoded again. See
  ``_cancelpoint``.

What a runner can do is declared up front in ``RunnerCapabilities``: the engine
validates requests and forms batches from it, without calling the runner.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ._errors import InvalidRequestError
from ._request import GenerationRequest
from ._sampling import SAMPLER_KINDS
from ._stepcache import CACHE_KINDS

if TYPE_CHECKING:
    import torch

    from ._adapters import AdapterInfo
    from ._sampling import Trajectory
    from ._stepcache import CacheMetrics

__all__ = [
    "AdapterRunner",
    "CheckpointRunner",
    "Runner",
    "RunnerCapabilities",
    "StepCacheRunner",
    "StopRun",
    "SuspendableRunner",
    "TrajectoryRunner",
    "WholeCallRunner",
    "runner_sequence",
    "shared_capabilities",
]

StateT = TypeVar("StateT")

#: Batch-key names that are request properties, not fields.
_DERIVED_KEYS = frozenset({"kind"})
#: Request fields that never go into a batch key.
_IMAGE_FIELDS = frozenset({"image", "mask"})


class StopRun(Exception):
    """Raised inside a runner call by the engine: stop now, decode nothing.

    A whole-call runner's ``on_step`` raises it, and so does ``cancel_point()`` in a
    runner that declares ``cancel_points`` (L71, L72).
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerCapabilities:
    """What a runner supports, declared so the engine never has to probe.

    Args:
        max_batch_size: most states one ``step`` call takes.
        can_join: whether a state may join a batch whose members are mid-way.
        batch_key_fields: request fields that must be equal for two requests
            to share a batch; ``"kind"`` (``GenerationRequest.kind``) may be one.
            Never ``image`` or ``mask``: a key is compared at every step boundary,
            and images are kept out of it (L74).
        previews: whether ``preview`` works.
        size_multiple: ``height`` and ``width`` must be multiples of it.
        extra_keys: the keys of ``GenerationRequest.extra`` that the runner reads.
        negative_prompt: whether ``negative_prompt`` is honoured.
        fixed_size: the only ``(height, width)`` the model makes, if it has one.
        whole_call: the runner cannot step: the engine calls ``run(state, on_step)``
            instead of ``step``, one request at a time, and ``on_step`` (called
            after every step) raises ``StopRun`` when the request must stop.
        suspendable: the runner implements ``SuspendableRunner``: a running
            request may be suspended between two steps and resumed later, alone or
            in another batch, with the output it would have had (L61). Needs
            ``can_join`` (a resumed state joins states at other steps) unless
            ``max_batch_size`` is 1; never with ``whole_call``.
        image_input: whether ``GenerationRequest.image`` (with ``strength``) is
            honoured: image-to-image. The runner runs ``request.denoise_steps``
            steps (L75).
        mask_input: whether ``GenerationRequest.mask`` is honoured: inpainting.
            Needs ``image_input``.
        frames: ``None`` for a runner that makes images; for a video runner
            ``(a, b)``: it makes ``num_frames`` with ``num_frames % a == b`` (Wan:
            ``(4, 1)``, 4k + 1 frames). A video runner needs ``num_frames`` in every
            request, an image runner refuses it (L70), and ``batch_key`` always
            holds ``num_frames`` for a video runner: frames are batch-wide.
        cancel_points: the runner calls ``cancel_point()`` inside ``step`` and
            ``decode`` and lets its ``StopRun`` through with its model clean: a step
            whose every member stopped, or a decode whose request stopped, is left
            at the next cancel point (L71, L72). Never with ``whole_call``.
        step_cache: the step-cache kinds (``StepCache.kind``) the runner applies
            (L80): it implements ``StepCacheRunner``. A request whose policy is of
            another kind is refused at ``submit``, naming ``cache``; ``"none"`` is
            always taken. The policy is never part of a batch key: cached and
            uncached requests share batches. Never with ``whole_call``.
        min_steps: the fewest steps the model runs (L4): a request whose
            ``num_steps`` is below it is refused at admission, and so is an edit
            whose ``denoise_steps`` (``num_steps x strength``) is, naming
            ``strength``. A scheduler may need more than one (diffusers'
            flow-matching Euler with a terminal shift divides by zero at one).
        max_steps: the most ``num_steps`` the model runs, or ``None`` for no bound
            of its own (L4): a scheduler that steps through its training timesteps
            has no more than it was trained with.
        max_adapters: the most adapters one request may name (L85); 0 (the
            default): the runner takes none. A runner that declares more implements
            ``AdapterRunner``. Adapters are never part of a batch key (L86).
        image_to_video: the runner makes a video from ``GenerationRequest.image`` (L69,
            with ``frames`` and ``image_input``): a request without an image is refused
            naming ``image``, one with a ``strength`` naming ``strength``.
        checkpoints: the runner implements ``CheckpointRunner``: a running
            request's state can be copied at a step boundary, made bytes, and
            restored in a fresh engine to continue exactly (L78). Never with
            ``whole_call``.
        samplers: the stochastic samplers (``SDESampler.kind``, ``DDIMSampler.kind``:
            ``"sde"``, ``"ddim"``) the runner runs (L100): it implements
            ``TrajectoryRunner``. A request whose sampler is of another kind is refused
            at ``submit``, naming ``sampler``; so is a sampler with a step cache, whose
            skipped model calls no trainer could recompute. Never with ``whole_call``.
    """

    max_batch_size: int = 1
    can_join: bool = False
    batch_key_fields: tuple[str, ...] = ("height", "width", "num_images")
    previews: bool = False
    size_multiple: int = 1
    extra_keys: frozenset[str] = frozenset()
    negative_prompt: bool = True
    fixed_size: tuple[int, int] | None = None
    whole_call: bool = False
    suspendable: bool = False
    image_input: bool = False
    mask_input: bool = False
    frames: tuple[int, int] | None = None
    cancel_points: bool = False
    step_cache: frozenset[str] = frozenset()
    min_steps: int = 1
    max_steps: int | None = None
    max_adapters: int = 0
    image_to_video: bool = False
    checkpoints: bool = False
    samplers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self._check_additions()
        if self.cancel_points and self.whole_call:
            raise ValueError("cancel_points: a whole-call runner stops at its on_step callback")
        if self.whole_call and (self.max_batch_size != 1 or self.can_join):
            raise ValueError("whole_call: a whole-call runner serves one request at a time")
        if self.suspendable and self.whole_call:
            raise ValueError("suspendable: a whole-call runner runs its own loop to the end")
        if self.suspendable and not self.can_join and self.max_batch_size != 1:
            raise ValueError(
                "suspendable: a resumed state joins states at other steps; declare can_join"
            )
        self._check_step_cache()
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size: must be >= 1")
        if self.max_adapters < 0 or (self.max_adapters and self.whole_call):
            raise ValueError("max_adapters: >= 0, and 0 for a whole-call runner")
        if self.min_steps < 1:
            raise ValueError(f"min_steps: must be >= 1, got {self.min_steps}")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(
                f"max_steps: must be >= min_steps ({self.min_steps}), got {self.max_steps}"
            )
        if self.size_multiple < 1:
            raise ValueError("size_multiple: must be >= 1")
        if self.mask_input and not self.image_input:
            raise ValueError("mask_input: a mask repaints an image; declare image_input")
        if self.frames is not None:
            period, remainder = self.frames
            if period < 1 or not 0 <= remainder < period:
                raise ValueError(f"frames: (a, b) needs a >= 1 and 0 <= b < a, got {self.frames}")
        fields = set(GenerationRequest.__dataclass_fields__) | _DERIVED_KEYS
        unknown = set(self.batch_key_fields) - fields
        if unknown:
            raise ValueError(f"batch_key_fields: unknown request fields {sorted(unknown)}")
        images = sorted(set(self.batch_key_fields) & _IMAGE_FIELDS)
        if images:
            raise ValueError(
                f"batch_key_fields: {images} would compare images at every boundary;"
                " use 'kind' to keep kinds of edits apart"
            )

    def _check_additions(self) -> None:
        """Image to video (L69) and checkpoints (L78): what they need."""
        if self.image_to_video and (self.frames is None or not self.image_input):
            raise ValueError("image_to_video: a video runner (frames) that takes image_input")
        if self.checkpoints and self.whole_call:
            raise ValueError("checkpoints: a whole-call runner runs its own loop to the end")
        if not isinstance(self.samplers, frozenset) or set(self.samplers) - set(SAMPLER_KINDS):
            raise ValueError(f"samplers: a frozenset of {list(SAMPLER_KINDS)}")
        if self.samplers and self.whole_call:
            raise ValueError("samplers: a whole-call runner runs its pipeline's own steps")

    def _check_step_cache(self) -> None:
        if not isinstance(self.step_cache, frozenset):
            raise ValueError("step_cache: must be a frozenset of cache kinds")
        unknown = sorted(set(self.step_cache) - set(CACHE_KINDS) - {"none"})
        if unknown or "none" in self.step_cache:
            raise ValueError(
                f"step_cache: the kinds a runner applies are {list(CACHE_KINDS[:-1])},"
                f" got {sorted(self.step_cache)}"
            )
        if self.step_cache and self.whole_call:
            raise ValueError("step_cache: a whole-call runner runs its pipeline's own loop")

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequestError`` naming the first field this runner cannot serve."""
        for index, name in enumerate(("height", "width")):
            value: int = getattr(request, name)
            if self.fixed_size is not None and value != self.fixed_size[index]:
                raise InvalidRequestError(
                    f"this model makes {self.fixed_size[0]}x{self.fixed_size[1]} images only,"
                    f" got {value}",
                    field=name,
                )
            if value % self.size_multiple:
                raise InvalidRequestError(
                    f"must be a multiple of {self.size_multiple} for this runner, got {value}",
                    field=name,
                )
        unknown = sorted(set(request.extra) - self.extra_keys)
        if unknown:
            known = ", ".join(sorted(self.extra_keys)) or "none"
            raise InvalidRequestError(
                f"unknown keys {unknown}; this runner accepts: {known}", field="extra"
            )
        if request.negative_prompt is not None and not self.negative_prompt:
            raise InvalidRequestError("this runner does not support it", field="negative_prompt")
        if request.image is not None and not self.image_input:
            raise InvalidRequestError("this runner does not take an input image", field="image")
        if request.mask is not None and not self.mask_input:
            raise InvalidRequestError("this runner does not inpaint", field="mask")
        if self.image_to_video:
            self._check_image_to_video(request)
        self._check_steps(request)
        self._check_frames(request.num_frames)
        self.check_cache(None if request.cache is None else request.cache.kind)
        self._check_adapters(len(request.adapter_pairs))
        self._check_sampler(request)

    def _check_sampler(self, request: GenerationRequest) -> None:
        """L100: a sampler of a kind this runner runs, and no step cache beside it."""
        sampler = request.sampler
        if sampler is None:
            return
        if sampler.kind not in self.samplers:
            runs = ", ".join(sorted(self.samplers)) or "none"
            raise InvalidRequestError(
                f"this runner cannot sample with {sampler.kind!r} (it runs: {runs})",
                field="sampler",
            )
        if request.cache is not None and request.cache.kind != "none":
            raise InvalidRequestError(
                "a step cache skips model calls that a trainer would compute: its"
                " log-probabilities could not be recomputed; give cache=StepCache(kind='none')",
                field="sampler",
            )

    def _check_adapters(self, count: int) -> None:
        """L85: at most ``max_adapters`` per request (the names are the engine's to check)."""
        if count > self.max_adapters:
            limit = self.max_adapters
            raise InvalidRequestError(
                "this runner takes no adapters"
                if not limit
                else f"this runner applies at most {limit} per request, got {count}",
                field="adapters",
            )

    @staticmethod
    def _check_image_to_video(request: GenerationRequest) -> None:
        """L69: an image-to-video runner animates an image: it needs one, and all its steps."""
        if request.image is None:
            raise InvalidRequestError(
                "this model makes a video from an image: give one", field="image"
            )
        if request.strength is not None:
            raise InvalidRequestError(
                "an image to video runs every step; leave strength out", field="strength"
            )

    def check_cache(self, kind: str | None) -> None:
        """L80: refuse a step-cache kind this runner does not apply, naming ``cache``."""
        if kind is None or kind == "none" or kind in self.step_cache:
            return
        applies = ", ".join(sorted(self.step_cache)) or "none"
        raise InvalidRequestError(
            f"this runner cannot apply a {kind!r} step cache (it applies: {applies})",
            field="cache",
        )

    def _check_steps(self, request: GenerationRequest) -> None:
        """L4: the steps the model can run, refused before any work rather than failed."""
        steps, low, high = request.num_steps, self.min_steps, self.max_steps
        if steps < low:
            raise InvalidRequestError(
                f"this model runs at least {low} steps, got {steps}", field="num_steps"
            )
        if high is not None and steps > high:
            raise InvalidRequestError(
                f"this model runs at most {high} steps, got {steps}", field="num_steps"
            )
        if request.denoise_steps < low:
            raise InvalidRequestError(
                f"this model runs at least {low} steps: strength {request.strength:g} x"
                f" num_steps {steps} runs {request.denoise_steps}",
                field="strength",
            )

    def _check_frames(self, frames: int | None) -> None:
        """L70: a video runner needs ``num_frames`` that keep its rule; others refuse it."""
        if self.frames is None:
            if frames is not None:
                raise InvalidRequestError(
                    "this runner makes images; leave num_frames out", field="num_frames"
                )
            return
        period, remainder = self.frames
        if frames is None:
            raise InvalidRequestError(
                f"this runner makes videos: give num_frames ({_frame_rule(period, remainder)})",
                field="num_frames",
            )
        if frames % period != remainder:
            raise InvalidRequestError(
                f"must be {_frame_rule(period, remainder)} for this runner, got {frames}",
                field="num_frames",
            )

    def batch_key(self, request: GenerationRequest) -> tuple[object, ...]:
        """The values that must match for requests to share a batch."""
        key = tuple(getattr(request, name) for name in self.batch_key_fields)
        if self.frames is not None and "num_frames" not in self.batch_key_fields:
            key += (request.num_frames,)
        return key


def _frame_rule(period: int, remainder: int) -> str:
    """``"4k + 1 (1, 5, 9, ...)"``: the counts ``n % period == remainder``, in words."""
    first = remainder or period
    counts = ", ".join(str(first + period * k) for k in range(3))
    if period == 1:
        return "any count"
    return f"{period}k + {remainder} ({counts}, ...)"


class Runner(Protocol[StateT]):
    """Drives one model on one device; called only from the engine's threads."""

    @property
    def capabilities(self) -> RunnerCapabilities:
        """What this runner supports."""
        ...

    def prepare(self, request: GenerationRequest, request_id: str) -> StateT:
        """Build the per-request state: prompt encoding, initial latents, scheduler."""
        ...

    def step(self, states: Sequence[StateT]) -> None:
        """Advance every state by one denoise step."""
        ...

    def preview(self, state: StateT) -> torch.Tensor | None:
        """Return a cheap preview ``[N, C, h, w]`` in [0, 1] of the current latents.

        ``C`` is 1, 3 or 4 (grey, RGB, RGBA), ``N`` the request's ``num_images``; any
        size. ``None`` when no preview can be made at this step. The engine checks it
        like an output (L24) and hands the consumer a CPU float32 copy.
        """
        ...

    def decode(self, state: StateT) -> torch.Tensor:
        """Return the final images ``[N, C, H, W]`` in [0, 1]."""
        ...

    def discard(self, state: StateT) -> None:
        """Free what ``state`` holds; the engine will not use it again."""
        ...

    def close(self) -> None:
        """Release the runner's own resources; no call follows."""
        ...


class StepCallback(Protocol):
    """What a whole-call runner calls at every step boundary (it raises to stop)."""

    def __call__(self, total: int | None = None) -> None:
        """Count a step; ``total`` is the loop's real step count, where it differs."""
        ...


class WholeCallRunner(Runner[StateT], Protocol):
    """A runner that declares ``whole_call``: it runs its own loop in ``run``."""

    def run(self, state: StateT, on_step: StepCallback) -> None:
        """Run every step, calling ``on_step`` after each; let ``StopRun`` through.

        ``on_step(total)`` may say how many steps the loop runs in all, when that is
        not the request's ``num_steps`` (an image-to-image call with strength < 1);
        step events then report it as their ``total``.
        """
        ...


class SuspendableRunner(Runner[StateT], Protocol):
    """A runner that declares ``suspendable``: its states can be parked between steps.

    The engine calls these from its worker thread, between two ``step`` calls; a
    parked state is never stepped, previewed or decoded until ``resume``, but may
    be discarded (from either engine thread) instead.
    """

    def state_bytes(self, state: StateT) -> int:
        """Return the bytes that suspending ``state`` would keep parked.

        The engine checks its ``max_parked_bytes`` bound with it before suspending.
        """
        ...

    def suspend(self, state: StateT, *, to_host: bool) -> None:
        """Park ``state``; with ``to_host``, move what it holds on the device to host memory.

        Everything the next step needs must be kept: latents, the scheduler's
        state, the random generator's state.
        """
        ...

    def resume(self, state: StateT) -> None:
        """Bring a parked ``state`` back, so that the next ``step`` continues it exactly."""
        ...


class CheckpointRunner(Runner[StateT], Protocol):
    """A runner that declares ``checkpoints``: its states can be saved and restored (L78).

    ``checkpoint`` runs in the worker thread at a step boundary and must be cheap (a
    copy of the tensors, on their device); ``checkpoint_bytes`` runs in the
    materializer thread, possibly while the next steps run; ``restore`` runs in
    the worker thread instead of ``prepare``.
    """

    def checkpoint(self, state: StateT) -> object:
        """Return a copy of what the next step of ``state`` needs; ``state`` goes on.

        Raises:
            Exception: the state cannot be checkpointed (the engine logs it and takes
                no more checkpoints of this request).
        """
        ...

    def checkpoint_bytes(self, copy: object) -> bytes:
        """Return ``copy`` (from ``checkpoint``) as bytes that ``restore`` takes."""
        ...

    def restore(
        self, request: GenerationRequest, request_id: str, data: bytes
    ) -> tuple[StateT, int]:
        """Rebuild the state ``data`` holds for ``request``; return it and its steps done.

        Its next ``step`` continues it exactly as the checkpointed state's would have.

        Raises:
            CheckpointError: ``data`` is corrupt, or of another model, omni_trio
                version or request; the engine then calls ``prepare``.
        """
        ...


class StepCacheRunner(Runner[StateT], Protocol):
    """A runner that declares ``step_cache``: it applies requests' step-cache policies.

    The policy is the request's ``cache`` (the engine puts its ``default_cache`` there
    before ``prepare``); the cache state is part of the request's state, created by
    ``prepare``, dropped by ``discard``, moved by ``suspend`` and ``resume`` (L82).
    """

    def cache_metrics(self, state: StateT) -> CacheMetrics | None:
        """Return what ``state``'s step cache did so far; ``None`` without a policy.

        The engine reads it once, just before it discards the state (L84).
        """
        ...

    def set_cache_threshold(self, state: StateT, threshold: float) -> None:
        """Use ``threshold`` for ``state``'s next model calls (first-block; L84).

        The engine calls it between two steps, only for a request whose policy has a
        ``max_threshold``, with a value from its ``threshold`` to that bound.
        """
        ...


class TrajectoryRunner(Runner[StateT], Protocol):
    """A runner that declares ``samplers``: it samples stochastically (L100)."""

    def trajectory(self, state: StateT) -> Trajectory:
        """Return the trajectory of ``state``'s request (it has ``return_trajectory``).

        Called once, in the materializer thread, after ``decode`` and before ``discard``.
        """
        ...


class AdapterRunner(Runner[StateT], Protocol):
    """A runner that declares ``max_adapters``: it loads adapters by name (L85-L87).

    Unlike the other calls, these four are safe from any thread while the runner
    serves: a load or unload never interleaves with a model call (the runner says
    how), and never changes the output of a request in flight.
    """

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load the LoRA at ``source`` (a file, or a state dict) as ``name``.

        Raises:
            AdapterError: ``name`` is loaded already, ``source`` is not a LoRA for
                this model (nothing of it stays loaded), or the bound of loaded
                adapters leaves no room.
        """
        ...

    def unload_adapter(self, name: str) -> None:
        """Unload ``name``; requests admitted later that name it are refused.

        Raises:
            AdapterError: ``name`` is not loaded, or live requests hold it.
        """
        ...

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """Return the adapters the runner knows, loaded or evicted, by name."""
        ...

    def adapter_names(self) -> frozenset[str]:
        """Return the names requests may use now (admission reads them, L85)."""
        ...


def runner_sequence(runners: Runner[Any] | Sequence[Runner[Any]]) -> list[Runner[Any]]:
    """``open_engine``'s runners as a list: one runner, or a sequence of them."""
    if isinstance(runners, Sequence) and not isinstance(runners, (str, bytes)):
        return list(runners)
    return [runners]


def shared_capabilities(runners: Sequence[Runner[Any]]) -> RunnerCapabilities:
    """The capabilities every runner declares, the same for all (L42).

    Raises:
        ValueError: no runner, or runners that declare different capabilities.
        TypeError: a runner's ``capabilities`` is not a ``RunnerCapabilities``.
    """
    if not runners:
        raise ValueError("runners: give at least one runner")
    found: RunnerCapabilities | None = None
    for runner in runners:
        capabilities = getattr(runner, "capabilities", None)
        if not isinstance(capabilities, RunnerCapabilities):
            raise TypeError("runner.capabilities must be a RunnerCapabilities")
        if found is not None and capabilities != found:
            # One admission validates and batches for all: what one worker refuses,
            # another must refuse too.
            raise ValueError("runners: every runner must declare the same capabilities")
        found = capabilities
    assert found is not None
    return found
