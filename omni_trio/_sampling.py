"""Stochastic sampling, as data: a request's sampler and the trajectory it returns (L100).

A request may replace its scheduler's deterministic step by a stochastic one
(``GenerationRequest.sampler``): the steps it names draw Gaussian noise from the
request's own generator, the others take the deterministic step of the same sampler.

- ``SDESampler``: the flow-matching families (Flux, SD3, Qwen-Image, Wan). The reverse
  SDE whose marginals are the flow's: with ``x = (1 - s) x0 + s e`` and the model's
  velocity ``v``, one step from ``s`` to ``s'`` (``dt = s' - s < 0``) is Gaussian with
  mean ``x + [v + g^2 / (2 s) (x + (1 - s) v)] dt`` and standard deviation
  ``g sqrt(-dt)``, where ``g = noise_level sqrt(s / (1 - s))`` (at ``s = 1``, where that is
  infinite, ``s'`` stands for ``s`` under the root's denominator). ``noise_level`` 0
  would be the Euler step of the ODE.
- ``DDIMSampler``: the UNet families (SD, SDXL): DDIM with ``eta > 0``, whose step is
  Gaussian with mean ``sqrt(a') x0 + sqrt(1 - a' - std^2) e`` and ``std = eta
  sqrt((1 - a') / (1 - a) (1 - a / a'))`` (``a``, ``a'``: the cumulative alphas of the
  step's timestep and of the one it steps to; ``x0``, ``e`` as the model predicts them).

Either way a step's next latent is ``mean + std z`` with ``z`` standard normal, and its
transition log-probability is the Gaussian's log-density at the next latent, as the
mean over the latent's elements (the convention of Flow-GRPO and DDPO's trainers: the
whole log-density is that times ``Trajectory.elements``), computed in float64 from the
float32 mean and reported in float32.

``Trajectory`` is what a request with ``return_trajectory`` gets back beside its images
(``GenerationOutput.trajectory``). Torch-free: the tensors are made by the runner (the
safetensors codec, ``Trajectory.to_safetensors`` and ``from_safetensors``, what the HTTP
server answers with, imports torch when called).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NoReturn, TypeAlias

from ._validate import check_float, check_int, fail_request

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_NOISE_LEVEL",
    "SAMPLER_KINDS",
    "TRAJECTORY_FORMAT",
    "DDIMSampler",
    "SDESampler",
    "Sampler",
    "SamplerKind",
    "Trajectory",
    "check_sampler",
    "parse_sampler",
    "sampler_record",
]

#: What a sampler is: the flow-matching SDE step, or DDIM with noise.
SamplerKind: TypeAlias = Literal["sde", "ddim"]

#: The kinds, in the order the docs list them.
SAMPLER_KINDS: tuple[SamplerKind, ...] = ("sde", "ddim")

#: The largest ``SDESampler.noise_level`` accepted. Flow-GRPO trains with 0.7 to 1; far
#: above, the SDE's drift term outgrows the step (picked to keep numbers sane, not
#: measured).
MAX_NOISE_LEVEL = 10.0

#: The most steps a sampler may name: beyond any step count an engine takes.
_MAX_STEP_INDEX = 100_000

#: The ``format`` in a trajectory's safetensors metadata (``Trajectory.to_safetensors``).
TRAJECTORY_FORMAT = "omni_trio.trajectory/1"

#: A trajectory's tensors, each stored under its field's name.
_TENSORS = ("latents", "timesteps", "schedule", "steps", "noise", "log_probs")


def _fail(name: str, message: str) -> NoReturn:
    """Refuse the sampler: the request's field is ``sampler``, the message names its own."""
    fail_request("sampler", f"{name}: {message}")


def _checked_steps(steps: object) -> tuple[int, ...] | None:
    """``steps`` as a sorted tuple of distinct step indices, or ``None`` (every step)."""
    if steps is None:
        return None
    if not isinstance(steps, tuple | list | range | frozenset | set):
        _fail("steps", f"must be a tuple of step indices or None, got {type(steps).__name__}")
    checked = [
        check_int(_fail, "steps", step, minimum=0, maximum=_MAX_STEP_INDEX) for step in steps
    ]
    if len(set(checked)) != len(checked):
        _fail("steps", "names a step twice")
    return tuple(sorted(checked))


def _check_fields(sampler: SDESampler | DDIMSampler, scale: str, maximum: float) -> None:
    """Check a sampler's noise scale (the field ``scale``: finite, in (0, ``maximum``])
    and its ``steps``, storing them as checked (a float, a sorted tuple)."""
    value = check_float(_fail, scale, getattr(sampler, scale), minimum=0.0, maximum=maximum)
    if value == 0.0:
        _fail(scale, "must be > 0 (0 is the deterministic step: leave sampler out)")
    object.__setattr__(sampler, scale, value)
    object.__setattr__(sampler, "steps", _checked_steps(sampler.steps))


@dataclass(frozen=True, slots=True, kw_only=True)
class SDESampler:
    """The flow-matching SDE step, with its transition log-probabilities (L100).

    Args:
        noise_level: ``a`` in the noise scale ``g = a sqrt(s / (1 - s))``: finite, > 0,
            at most ``MAX_NOISE_LEVEL``. Flow-GRPO's default, 0.7, by default.
        steps: the steps (0-based, among the steps that run) that draw noise; the
            others take the ODE's Euler step. ``None`` (the default): every step.
            Each below the request's ``denoise_steps``, each once; stored sorted.

    Raises:
        InvalidRequestError: a field has a wrong type or value (``field`` is
            ``"sampler"``, the message names the sampler's field).
    """

    kind: ClassVar[SamplerKind] = "sde"

    noise_level: float = 0.7
    steps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_fields(self, "noise_level", MAX_NOISE_LEVEL)

    @property
    def scale(self) -> float:
        """The noise scale of the sampler: ``noise_level``."""
        return self.noise_level


@dataclass(frozen=True, slots=True, kw_only=True)
class DDIMSampler:
    """DDIM with ``eta > 0``, with its transition log-probabilities (L100).

    The runner steps the request's timesteps as a DDIM scheduler made from its
    pipeline's scheduler's config does (``x0`` is never clipped, as latent diffusion
    configures it).

    Args:
        eta: DDIM's ``eta``: finite, in (0, 1] (1: DDPM's variance). 1 by default.
        steps: as ``SDESampler.steps``; a step whose variance is 0 (DDIM's last step,
            onto a cumulative alpha of 1) draws no noise whether named or not.

    Raises:
        InvalidRequestError: as ``SDESampler`` raises it.
    """

    kind: ClassVar[SamplerKind] = "ddim"

    eta: float = 1.0
    steps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_fields(self, "eta", 1.0)

    @property
    def scale(self) -> float:
        """The noise scale of the sampler: ``eta``."""
        return self.eta


#: A request's stochastic sampler.
Sampler: TypeAlias = SDESampler | DDIMSampler


def check_sampler(sampler: object, denoise_steps: int) -> None:
    """Refuse ``sampler`` (naming ``sampler``) unless it is one, with its steps below
    ``denoise_steps``."""
    if not isinstance(sampler, SDESampler | DDIMSampler):
        fail_request(
            "sampler", f"must be an SDESampler, a DDIMSampler or None, got {type(sampler).__name__}"
        )
    if sampler.steps is not None and sampler.steps and sampler.steps[-1] >= denoise_steps:
        _fail(
            "steps",
            f"step {sampler.steps[-1]} is past the request's {denoise_steps} steps"
            f" (0 to {denoise_steps - 1})",
        )


def sampler_record(sampler: Sampler) -> dict[str, object]:
    """``sampler`` as JSON data: its kind, its scale's field, its steps (a list or ``None``)."""
    steps = None if sampler.steps is None else list(sampler.steps)
    if isinstance(sampler, SDESampler):
        return {"kind": "sde", "noise_level": sampler.noise_level, "steps": steps}
    return {"kind": "ddim", "eta": sampler.eta, "steps": steps}


def parse_sampler(record: object) -> Sampler:
    """The sampler ``sampler_record`` wrote (a JSON object), checked as any sampler is.

    Raises:
        InvalidRequestError: not such a record, or a field is refused (``field`` is
            ``"sampler"``).
    """
    if not isinstance(record, dict):
        fail_request("sampler", f"must be an object, got {type(record).__name__}")
    values: dict[str, Any] = dict(record)
    kind = values.pop("kind", None)
    if isinstance(values.get("steps"), list):
        values["steps"] = tuple(values["steps"])
    if kind not in SAMPLER_KINDS:
        _fail("kind", f"must be one of {list(SAMPLER_KINDS)}, got {str(kind)[:40]!r}")
    make: type[Sampler] = SDESampler if kind == "sde" else DDIMSampler
    unknown = sorted(set(values) - {"steps", "noise_level" if kind == "sde" else "eta"})
    if unknown:
        _fail(str(unknown[0])[:40], f"is not a field of a {kind!r} sampler")
    return make(**values)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Trajectory:
    """A request's denoising trajectory (L100): CPU float32 tensors, ``N`` its images.

    ``S`` is the steps that ran, ``K`` those of them that drew noise. A transition's
    log-probability is recomputed trainer-side by ``omni_trio.runners.transition_log_prob``
    from ``latents[:, k]``, ``latents[:, k + 1]`` and the model's prediction at
    ``latents[:, k]`` and ``timesteps[k]``.

    Attributes:
        sampler: the request's sampler.
        prediction: what the model predicts: ``"flow"`` (a velocity), or for DDIM
            ``"epsilon"``, ``"v_prediction"`` or ``"sample"``.
        latents: ``[N, S + 1, ...]``: the latents before the first step and after each
            step, as the model takes them (Flux's and Qwen-Image's packed tokens), in
            float32 (the model's dtype's values, exactly).
        timesteps: ``[S]``: each step's timestep, as the denoiser was given it.
        schedule: ``[S, 2]``: each step's ``(s, s')`` (the SDE's sigmas) or ``(a, a')``
            (DDIM's cumulative alphas), float32.
        steps: ``[K]`` int64: the steps that drew noise, ascending.
        noise: ``[N, K, ...]``: the standard normal noise each of them drew.
        log_probs: ``[N, K]``: each of their transition log-probabilities (the mean
            over a latent's elements of the Gaussian's log-density).
    """

    sampler: Sampler
    prediction: str
    latents: torch.Tensor
    timesteps: torch.Tensor
    schedule: torch.Tensor
    steps: torch.Tensor
    noise: torch.Tensor
    log_probs: torch.Tensor

    @property
    def elements(self) -> int:
        """The elements of one image's latent: ``log_probs`` times it is the log-density."""
        return math.prod(self.latents.shape[2:])

    def to_safetensors(self) -> bytes:
        """This trajectory as the bytes of a safetensors file (what the HTTP server sends).

        Each tensor is stored under its field's name (``latents``, ``timesteps``,
        ``schedule``, ``steps``, ``noise``, ``log_probs``) with its dtype and shape; the
        metadata holds ``format`` (``TRAJECTORY_FORMAT``), ``sampler`` (its
        ``sampler_record`` as JSON) and ``prediction``. ``from_safetensors`` reads it
        back, bitwise.
        """
        import safetensors.torch
        import torch

        # Copies: safetensors takes neither a view nor two tensors sharing memory.
        tensors = {
            name: getattr(self, name).detach().cpu().clone(memory_format=torch.contiguous_format)
            for name in _TENSORS
        }
        metadata = {
            "format": TRAJECTORY_FORMAT,
            "sampler": json.dumps(sampler_record(self.sampler)),
            "prediction": self.prediction,
        }
        data: bytes = safetensors.torch.save(tensors, metadata=metadata)
        return data

    @classmethod
    def from_safetensors(cls, data: bytes) -> Trajectory:
        """The trajectory ``to_safetensors`` wrote: equal tensors (bitwise), CPU.

        Raises:
            ValueError: ``data`` is not a trajectory's safetensors file (one line says why).
        """
        import safetensors.torch

        metadata = _safetensors_metadata(data)
        if metadata.get("format") != TRAJECTORY_FORMAT:
            raise ValueError(f"not a trajectory: its format is not {TRAJECTORY_FORMAT!r}")
        try:
            tensors = safetensors.torch.load(data)
            sampler = parse_sampler(json.loads(metadata["sampler"]))
        except Exception as exc:  # SafetensorError, JSON, a refused sampler: one line
            raise ValueError(f"not a trajectory: {type(exc).__name__}: {exc}") from None
        missing = [name for name in _TENSORS if name not in tensors]
        if missing or "prediction" not in metadata:
            raise ValueError(f"not a trajectory: no {(missing or ['prediction'])[0]}")
        return cls(
            sampler=sampler,
            prediction=metadata["prediction"],
            latents=tensors["latents"],
            timesteps=tensors["timesteps"],
            schedule=tensors["schedule"],
            steps=tensors["steps"],
            noise=tensors["noise"],
            log_probs=tensors["log_probs"],
        )


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (8 bytes of its length, then
    JSON); ``{}`` where it has none.

    Raises:
        ValueError: the header is cut short or not a JSON object.
    """
    if len(data) < 8:
        raise ValueError("not a trajectory: shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise ValueError("not a trajectory: its safetensors header is cut short")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        raise ValueError("not a trajectory: its safetensors header is not JSON") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict):
        return {}
    return {str(key): str(value) for key, value in metadata.items()}
