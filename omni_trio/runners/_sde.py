"""Stochastic steps with their log-probabilities (L100): the flow-matching SDE, DDIM with eta.

A request with a ``sampler`` (``omni_trio.SDESampler`` or ``omni_trio.DDIMSampler``)
takes every step here instead of its scheduler's (``Family.scheduler_step``): each step
is ``next = mean + std z``, with ``mean = cx x + cp prediction`` (``x`` the latents,
``prediction`` the model's guided output, both in float32; ``cx``, ``cp`` and ``std``
from the step's two schedule values, ``step_coefficients``), ``z`` standard normal from
the request's own generator where the step draws noise, none elsewhere. ``next`` goes
back to the latents' dtype, and the step's log-probability is the Gaussian's
log-density at that stored value (``log_density``). ``omni_trio._sampling`` states the
two samplers' formulas; this module computes them.

Exactness: the mean is elementwise float32 arithmetic, the same bits whatever the
batch; the log-density sums each image's squared differences in float64, one image at
a time, so its value depends on that image alone. ``transition_log_prob`` is the
trainer's side: the same two functions over the returned latents and the trainer's own
prediction, which with the same weights and the same prediction gives the reported
value bitwise (the prediction's own batch invariance is ``_invariant``'s).

The state a request keeps (``SamplerState``): the schedule of its steps, and where it
returns a trajectory, every step's latents, noise and log-probability so far, in
``record``, a dictionary that suspension parks with the rest of the state and a
checkpoint saves (L61, L78). The noise comes from the request's generator, whose state
both keep already: a resumed or restored request draws what it would have drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._sampling import DDIMSampler, Sampler, SDESampler, Trajectory

__all__ = [
    "SamplerState",
    "log_density",
    "sampler_kinds",
    "sampler_scheduler",
    "step_coefficients",
    "transition_log_prob",
]

#: ``0.5 log(2 pi)``: the Gaussian's normalising term, per element.
_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)

#: What a DDIM model may predict (its scheduler's ``prediction_type``).
_DDIM_PREDICTIONS = ("epsilon", "v_prediction", "sample")


def _is_flow(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps a flow-matching schedule (sigmas from 1 to 0, velocity)."""
    config = scheduler.config
    return (
        type(scheduler).__name__.startswith("FlowMatch")
        or bool(config.get("use_flow_sigmas"))
        or config.get("prediction_type") == "flow_prediction"
    )


def sampler_kinds(scheduler: Any, offered: frozenset[str]) -> frozenset[str]:
    """The samplers of ``offered`` (a family's) that ``scheduler`` (a pipeline's) can run:
    ``"sde"`` over a flow-matching schedule, ``"ddim"`` over cumulative alphas and a
    prediction DDIM takes."""
    kinds = set()
    if "sde" in offered and _is_flow(scheduler):
        kinds.add("sde")
    if (
        "ddim" in offered
        and hasattr(scheduler, "alphas_cumprod")
        and scheduler.config.get("prediction_type", "epsilon") in _DDIM_PREDICTIONS
    ):
        kinds.add("ddim")
    return frozenset(kinds)


def sampler_scheduler(pipe: Any, sampler: Sampler) -> Any:
    """The request's own scheduler where its sampler needs another than its pipeline's
    kind: a DDIM one made from the pipeline's config (its timesteps and alphas) for
    DDIM; ``None`` for the SDE (it reads the pipeline's kind's sigmas)."""
    if isinstance(sampler, DDIMSampler):
        from diffusers import DDIMScheduler

        ddim: Any = DDIMScheduler  # untyped
        return ddim.from_config(pipe.scheduler.config)
    return None


def _flow_schedule(scheduler: Any, steps: int) -> torch.Tensor:
    sigmas = getattr(scheduler, "sigmas", None)
    if not isinstance(sigmas, torch.Tensor) or sigmas.dim() != 1 or len(sigmas) < steps + 1:
        raise ValueError(
            f"the SDE sampler needs a flow-matching schedule of one sigma per step and a"
            f" last one; {type(scheduler).__name__} has none"
        )
    own = sigmas[len(sigmas) - steps - 1 :].to(device="cpu", dtype=torch.float32)
    return torch.stack([own[:-1], own[1:]], dim=1)


def _ddim_schedule(scheduler: Any, timesteps: torch.Tensor) -> torch.Tensor:
    """Each step's ``(a, a')`` as DDIM's step reads them: the previous timestep is
    ``t - num_train_timesteps // num_inference_steps``, the final alpha below 0."""
    alphas = scheduler.alphas_cumprod.to(device="cpu", dtype=torch.float32)
    final = torch.as_tensor(scheduler.final_alpha_cumprod, dtype=torch.float32)
    ratio = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    rows = []
    for t in timesteps.tolist():
        previous = int(t) - ratio
        rows.append(torch.stack([alphas[int(t)], alphas[previous] if previous >= 0 else final]))
    return torch.stack(rows)


def step_coefficients(
    sampler: Sampler, prediction: str, schedule: torch.Tensor, *, drawn: bool = True
) -> tuple[float, float, float]:
    """``(cx, cp, std)`` of one step from its schedule row ``(s, s')`` or ``(a, a')``: its
    mean is ``cx x + cp prediction``, its noise's standard deviation ``std`` (0: the
    step is deterministic). Python floats (float64) from the float32 schedule.

    ``drawn=False``: the sampler's deterministic step (noise level or eta 0): the flow's
    Euler step, DDIM's.
    """
    first, second = (float(value) for value in schedule.tolist())
    scale = sampler.scale if drawn else 0.0
    if isinstance(sampler, SDESampler):
        sigma, following = first, second
        dt = following - sigma
        if scale == 0.0:
            return 1.0, dt, 0.0
        # At s = 1 (a schedule that starts at pure noise) s / (1 - s) is infinite.
        below = following if sigma >= 1.0 else sigma
        g = scale * math.sqrt(sigma / (1.0 - below))
        drift = g * g / (2.0 * sigma)
        return 1.0 + drift * dt, (1.0 + drift * (1.0 - sigma)) * dt, g * math.sqrt(-dt)
    alpha, following = first, second
    variance = (1.0 - following) / (1.0 - alpha) * (1.0 - alpha / following)
    std = scale * math.sqrt(max(variance, 0.0))
    root, root_next = math.sqrt(alpha), math.sqrt(following)
    beta, beta_next = math.sqrt(1.0 - alpha), math.sqrt(max(1.0 - following - std * std, 0.0))
    # x0 and e as DDIM reads them from the prediction, each linear in (x, prediction).
    if prediction == "epsilon":  # x0 = (x - beta p) / root, e = p
        return root_next / root, beta_next - root_next * beta / root, std
    if prediction == "v_prediction":  # x0 = root x - beta p, e = root p + beta x
        return root_next * root + beta_next * beta, beta_next * root - root_next * beta, std
    # "sample": x0 = p, e = (x - root p) / beta
    return beta_next / beta, root_next - beta_next * root / beta, std


def _mean(x: torch.Tensor, prediction: torch.Tensor, cx: float, cp: float) -> torch.Tensor:
    """``cx x + cp prediction`` in float32, elementwise (the same bits in any batch)."""
    mean: torch.Tensor = x.float() * cx + prediction.float() * cp
    return mean


def log_density(sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Each image's Gaussian log-density of ``sample`` around ``mean`` (``[N, ...]``),
    averaged over its elements: ``[N]`` float32.

    Each image's squared differences are summed in float64 on its own, so the value of
    one image never depends on the others, nor on how many there are.
    """
    count = math.prod(sample.shape[1:])
    scale = 1.0 / (2.0 * std * std * count)
    constant = math.log(std) + _HALF_LOG_TWO_PI
    values = []
    for index in range(sample.shape[0]):
        difference = sample[index].double() - mean[index].double()
        values.append(-(difference * difference).sum() * scale - constant)
    return torch.stack(values).float()


@dataclass(eq=False)
class SamplerState:
    """A request's sampler inside its ``RequestState``: its steps' schedule and its record.

    ``record`` holds, where the request returns its trajectory, ``"latents"`` (the
    latents before the first step and after each step, float32, on the latents'
    device), ``"noise"`` and ``"log_probs"`` (one per step that drew noise) and
    ``"steps"`` (those steps); it is one of the state's holders that a suspension
    parks and a checkpoint saves (see ``_park``, ``_checkpoint``).
    """

    sampler: Sampler
    prediction: str
    schedule: torch.Tensor
    timesteps: torch.Tensor
    returns: bool
    record: dict[str, list[Any]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        sampler: Sampler,
        scheduler: Any,
        timesteps: torch.Tensor,
        latents: torch.Tensor,
        *,
        returns: bool,
    ) -> SamplerState:
        """The sampler state of a request just prepared (its scheduler's timesteps set).

        Raises:
            ValueError: the scheduler has no schedule this sampler reads.
        """
        steps = len(timesteps)
        if isinstance(sampler, SDESampler):
            schedule, prediction = _flow_schedule(scheduler, steps), "flow"
        else:
            schedule = _ddim_schedule(scheduler, timesteps)
            prediction = str(scheduler.config.get("prediction_type", "epsilon"))
        state = cls(sampler, prediction, schedule, timesteps.detach().float().cpu(), returns)
        if returns:
            state.record = {
                "latents": [latents.detach().float().clone()],
                "noise": [],
                "log_probs": [],
                "steps": [],
            }
        return state

    def draws(self, step: int) -> bool:
        """Whether ``step`` draws noise by the sampler's ``steps`` (a zero variance aside)."""
        steps = self.sampler.steps
        return steps is None or step in steps

    def step(
        self,
        latents: torch.Tensor,
        prediction: torch.Tensor,
        step: int,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """The latents after ``step`` (0-based among the request's steps), in their dtype.

        Draws the step's noise from ``generator`` (the request's) where it draws any.
        """
        cx, cp, std = step_coefficients(
            self.sampler, self.prediction, self.schedule[step], drawn=self.draws(step)
        )
        mean = _mean(latents, prediction, cx, cp)
        noise: torch.Tensor | None = None
        following: torch.Tensor
        if std > 0.0:
            from diffusers.utils.torch_utils import randn_tensor

            noise = randn_tensor(
                tuple(mean.shape), generator=generator, device=mean.device, dtype=torch.float32
            )
            following = (mean + noise * std).to(latents.dtype)
        else:
            following = mean.to(latents.dtype)
        if self.returns:
            record = self.record
            record["latents"].append(following.detach().float().clone())
            if noise is not None:
                record["noise"].append(noise)
                record["log_probs"].append(log_density(following, mean, std))
                record["steps"].append(step)
        return following

    def trajectory(self) -> Trajectory:
        """The trajectory so far (every step, once the request finished), on the CPU."""
        record = self.record
        latents = torch.stack([t.cpu() for t in record["latents"]], dim=1)
        images = latents.shape[0]
        noise = (
            torch.stack([t.cpu() for t in record["noise"]], dim=1)
            if record["noise"]
            else latents.new_zeros((images, 0, *latents.shape[2:]))
        )
        log_probs = (
            torch.stack([t.cpu() for t in record["log_probs"]], dim=1)
            if record["log_probs"]
            else latents.new_zeros((images, 0))
        )
        return Trajectory(
            sampler=self.sampler,
            prediction=self.prediction,
            latents=latents,
            timesteps=self.timesteps.clone(),
            schedule=self.schedule.clone(),
            steps=torch.tensor(record["steps"], dtype=torch.int64),
            noise=noise,
            log_probs=log_probs,
        )

    def restore(self, record: dict[str, Any], device: torch.device) -> None:
        """Take a checkpoint's record (on the host) back onto ``device``.

        Raises:
            ValueError: the record does not fit (another request's, or cut).
        """
        if set(record) != set(self.record):
            raise ValueError("its sampler's record does not fit the request")
        latents = record["latents"]
        if not latents or latents[0].shape != self.record["latents"][0].shape:
            raise ValueError("its sampler's latents do not fit the request")
        self.record = {
            name: [v.to(device) if isinstance(v, torch.Tensor) else int(v) for v in values]
            for name, values in record.items()
        }


def transition_log_prob(
    trajectory: Trajectory,
    step: int,
    prediction: torch.Tensor,
    *,
    images: Sequence[int] | None = None,
) -> torch.Tensor:
    """Recompute step ``step``'s transition log-probability trainer-side (L100).

    ``prediction`` is the model's (guided) output at ``trajectory.latents[:, step]`` and
    ``trajectory.timesteps[step]``, computed by the caller with the weights to score
    (it may require grad: the result then does). With the rollout's weights and its
    prediction's bits, the result is ``trajectory.log_probs[:, k]`` (``k`` the step's
    place in ``trajectory.steps``) bitwise.

    Args:
        trajectory: a request's trajectory (``GenerationOutput.trajectory``).
        step: a step that drew noise (one of ``trajectory.steps``).
        prediction: ``[n, ...]``: the prediction for the images ``images`` (all, by
            default), as the model's output for them, of the latents' shape.
        images: which of the request's images ``prediction`` is for.

    Returns:
        ``[n]`` float32: each image's log-probability of its step (the mean over the
        latent's elements of the Gaussian log-density).

    Raises:
        ValueError: ``step`` drew no noise, or ``prediction`` has another shape.
    """
    drawn = trajectory.steps.tolist()
    if step not in drawn:
        raise ValueError(f"step {step} drew no noise (the steps that did: {drawn})")
    chosen = list(range(trajectory.latents.shape[0])) if images is None else list(images)
    latents = trajectory.latents[chosen]
    if tuple(prediction.shape) != tuple(latents.shape[:1] + latents.shape[2:]):
        raise ValueError(
            f"prediction: shape {list(prediction.shape)}, the latents of those images"
            f" are {[len(chosen), *latents.shape[2:]]}"
        )
    cx, cp, std = step_coefficients(
        trajectory.sampler, trajectory.prediction, trajectory.schedule[step]
    )
    mean = _mean(latents[:, step].to(prediction.device), prediction, cx, cp)
    return log_density(latents[:, step + 1].to(prediction.device), mean, std)
