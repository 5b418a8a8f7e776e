"""Stochastic sampling with log-probabilities (L100): trajectories a trainer recomputes.

- a sampled request's trajectory and images are the same, bitwise, alone and in a
  batch whose other members join and leave at step boundaries, for every family that
  samples (the SDE on Flux, SD3, Qwen-Image and Wan; DDIM with eta on SD and SDXL);
- preempted and resumed, or restored from a checkpoint, it equals its uninterrupted run;
- a "trainer" that calls the denoiser itself on the returned latents (Flux's
  transformer, SD's UNet with guidance) and recomputes each transition's
  log-probability gets the reported float32 value bitwise;
- each step is the Gaussian the sampler states: its mean is the SDE's (from the
  predicted x0 and noise) and DDIM's (diffusers' ``DDIMScheduler.step`` with the same
  noise), its log-probability torch's Normal's;
- a runner, a family or a scheduler that cannot sample so refuses it by name.

Determinism: tiny pipelines with seeded weights, built once; one torch thread; a
gated runner holds the worker between steps where members must join or leave at a
known boundary. Every noise draw comes from the request's own seeded generator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, row_invariant, transition_log_prob
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET
from tests.support.runners import GatedDiffusers, request, resumed_and_uninterrupted, tiny

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

#: The families that sample, each with its sampler's kind.
SAMPLED = {"flux": "sde", "sd3": "sde", "qwen-image": "sde", "wan": "sde", "sd": "ddim"}
SAMPLED_XL = {"sdxl": "ddim"}


def sampler_of(kind: str, **fields: Any) -> ot.SDESampler | ot.DDIMSampler:
    if {**SAMPLED, **SAMPLED_XL}[kind] == "sde":
        return ot.SDESampler(**fields)
    return ot.DDIMSampler(**fields)


def sampled(kind: str, **fields: Any) -> ot.GenerationRequest:
    """``request(kind, ...)`` with its family's sampler (every step draws noise) and its
    trajectory returned."""
    sampler = fields.pop("sampler", None) or sampler_of(kind)
    return request(kind, sampler=sampler, return_trajectory=True, **fields)


def assert_same(first: ot.GenerationOutput, second: ot.GenerationOutput) -> None:
    """Bitwise: the images (a video's frames) and every tensor of the trajectories."""
    assert torch.equal(first.images, second.images)
    if first.video is not None:
        assert second.video is not None and torch.equal(first.video, second.video)
    mine, theirs = first.trajectory, second.trajectory
    assert mine is not None and theirs is not None
    assert mine.sampler == theirs.sampler and mine.prediction == theirs.prediction
    for name in ("latents", "timesteps", "schedule", "steps", "noise", "log_probs"):
        assert torch.equal(getattr(mine, name), getattr(theirs, name)), name


async def alone(kind: str, r: ot.GenerationRequest) -> ot.GenerationOutput:
    """``r`` on a fresh engine that batches nothing."""
    options = ot.EngineConfig(max_batch_size=1)
    async with ot.open_engine(DiffusersRunner(tiny(kind)), options) as engine:
        return await engine.generate(r)


@pytest.mark.parametrize("kind", [*SAMPLED, *SAMPLED_XL])
async def test_a_trajectory_is_the_same_alone_and_as_members_join_and_leave(kind: str) -> None:
    """L100: a sampled request shares its first two steps with a plain request that then
    leaves, and its last with a sampled one that joins; its images and its whole
    trajectory (latents, noise, timesteps, log-probabilities) equal its run alone,
    bitwise, and so do the joiner's. Tiny Wan to 1e-5 only: its time embedding is 24
    wide, so a batch's SiLU over it ends in a partial vector that the CPU's scalar exp
    computes (a model's widths, multiples of 32, never do)."""
    first = sampled(kind, num_steps=4, seed=1, prompt="first")
    leaver = request(kind, num_steps=2, seed=2, prompt="other")
    joiner = sampled(kind, num_steps=3, seed=3, prompt="third")
    runner = GatedDiffusers(tiny(kind))
    with anyio.fail_after(BUDGET * 2):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            handles = [engine.submit(first), engine.submit(leaver)]
            runner.release(2)
            await runner.wait_arrived(3)
            handles.append(engine.submit(joiner))  # joins at the next boundary
            runner.open_gate()
            outputs = []
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            stats = engine.statistics()
        # Two with the leaver, one alone, one with the joiner, the joiner's last two alone.
        assert (stats.steps_run, stats.batch_steps) == (9, 6)
        for output, r in ((outputs[0], first), (outputs[2], joiner)):
            solo = await alone(kind, r)
            if kind == "wan":
                assert output.trajectory is not None and solo.trajectory is not None
                for name in ("latents", "noise", "log_probs"):
                    mine, theirs = getattr(output.trajectory, name), getattr(solo.trajectory, name)
                    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
            else:
                assert_same(output, solo)
    trajectory = outputs[0].trajectory
    assert trajectory is not None
    steps = trajectory.steps.tolist()
    assert steps == [0, 1, 2, 3]
    assert trajectory.latents.shape[:2] == (1, 5)
    assert trajectory.noise.shape[:2] == (1, len(steps))
    assert trajectory.log_probs.dtype == torch.float32
    assert bool(torch.isfinite(trajectory.log_probs).all())


@pytest.mark.parametrize("park_on_host", [True, False], ids=["host", "device"])
async def test_a_preempted_sampled_request_resumes_to_its_uninterrupted_trajectory(
    park_on_host: bool,
) -> None:
    """L100, L61: preempted after its first step (its trajectory so far parked with its
    state) and resumed, a sampled request's images and trajectory equal its
    uninterrupted run, bitwise: its generator draws the noise it would have drawn."""
    low = sampled("flux", num_steps=4, seed=5, prompt="low")
    high = request("flux", num_steps=2, seed=6, prompt="high", priority=1)
    resumed, uninterrupted, parked = await resumed_and_uninterrupted(
        tiny("flux"), low, high, park_on_host=park_on_host
    )
    assert_same(resumed, uninterrupted)
    trajectory = uninterrupted.trajectory
    assert trajectory is not None
    # What was parked holds the trajectory so far: two latents and a step's noise.
    assert parked >= 3 * trajectory.latents[:, 0].nbytes


async def test_a_sampled_request_restores_its_trajectory_from_a_checkpoint() -> None:
    """L100, L78: a checkpoint after step 2 holds the trajectory so far; restored in a
    fresh engine, the request ends with its uninterrupted images and trajectory."""
    r = sampled("flux", num_steps=4, seed=8, prompt="saved")
    taken: list[ot.Checkpoint] = []
    policy = ot.CheckpointPolicy(every_s=0, sink=taken.append)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("flux"))) as engine:
            async with engine.submit(r, checkpoint=policy) as handle:
                whole = await handle.result()
        async with ot.open_engine(DiffusersRunner(tiny("flux"))) as engine:
            async with engine.submit(r, resume_from=taken[1].data) as handle:
                restored = await handle.result()
    assert taken[1].step == 2
    assert_same(restored, whole)


def flux_prediction(r: ot.GenerationRequest, latents: torch.Tensor, t: torch.Tensor) -> Any:
    """The trainer's forward: Flux's transformer called on the returned latents, its
    conditioning made by the pipeline's own encoder, as a trainer does."""
    pipe = tiny("flux")
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=r.prompt, prompt_2=None, num_images_per_prompt=latents.shape[0]
    )
    side = 2 * (r.height // (pipe.vae_scale_factor * 2))
    image_ids = pipe._prepare_latent_image_ids(1, side // 2, side // 2, "cpu", embeds.dtype)
    return pipe.transformer(
        hidden_states=latents,
        timestep=t.expand(latents.shape[0]) / 1000,
        guidance=torch.full([latents.shape[0]], r.guidance_scale),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]


def sd_prediction(r: ot.GenerationRequest, latents: torch.Tensor, t: torch.Tensor) -> Any:
    """The trainer's forward: SD's UNet on ``[uncond, cond]`` rows, guided."""
    pipe = tiny("sd")
    count = latents.shape[0]
    positive, negative = pipe.encode_prompt(r.prompt, "cpu", count, True, r.negative_prompt)
    out = pipe.unet(
        torch.cat([latents, latents]),
        t.expand(2 * count).to(torch.int64),
        encoder_hidden_states=torch.cat([negative, positive]),
        return_dict=False,
    )[0]
    uncond, text = out.chunk(2)
    return uncond + r.guidance_scale * (text - uncond)


@pytest.mark.parametrize(
    ("kind", "forward"), [("flux", flux_prediction), ("sd", sd_prediction)], ids=["flux", "sd"]
)
async def test_a_trainer_recomputes_every_log_probability_bitwise(kind: str, forward: Any) -> None:
    """L100: the test RL users care about. A sampled request of one image runs alone, two
    of two images each share a batch; a trainer calls the denoiser itself on each
    returned latent, in batches of its own (each image alone, then all of a request's
    images of a step at once) under ``row_invariant``, and ``transition_log_prob`` gives
    every reported log-probability, bitwise: 0 mismatch, in float32."""
    lone = sampled(kind, seed=9, prompt="alone")
    pair = [sampled(kind, seed=seed, prompt=f"p{seed}", num_images=2) for seed in (1, 2)]
    runner = GatedDiffusers(tiny(kind))
    with anyio.fail_after(BUDGET):
        outputs = [await alone(kind, lone)]
        async with ot.open_engine(runner) as engine:
            handles = [engine.submit(r) for r in pair]
            await runner.wait_arrived(1)  # the second joins at the latest after this step
            runner.open_gate()
            for handle in handles:
                async with handle:
                    outputs.append(await handle.result())
            assert engine.statistics().batch_steps <= 5
    checked = 0
    denoiser = tiny(kind).transformer if kind == "flux" else tiny(kind).unet
    with torch.no_grad(), row_invariant(denoiser):
        for r, output in zip([lone, *pair], outputs, strict=True):
            trajectory = output.trajectory
            assert trajectory is not None
            for place, step in enumerate(trajectory.steps.tolist()):
                t = trajectory.timesteps[step]
                reported = trajectory.log_probs[:, place]
                for image in range(r.num_images):
                    latents = trajectory.latents[image : image + 1, step]
                    mine = transition_log_prob(
                        trajectory, step, forward(r, latents, t), images=[image]
                    )
                    assert torch.equal(mine, reported[image : image + 1]), (r.seed, step)
                    checked += 1
                every = forward(r, trajectory.latents[:, step], t)
                assert torch.equal(transition_log_prob(trajectory, step, every), reported)
    assert checked == (1 + 2 * 2) * 4


def test_a_flow_step_is_the_sdes_gaussian() -> None:
    """L100: the SDE step's mean, written from the predicted x0 and noise
    (``x + [v + g^2 / (2 s) (x + (1 - s) v)] dt``, ``g = a sqrt(s / (1 - s))``), and its
    log-probability, torch's Normal's mean log-density at the next latent."""
    from omni_trio.runners._sde import SamplerState

    generator = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 16, 8, generator=generator), torch.randn(2, 16, 8, generator=generator)
    sigmas = torch.tensor([0.8, 0.55, 0.0])
    scheduler = type("Sigmas", (), {"sigmas": sigmas})()
    sampler = ot.SDESampler(noise_level=0.9)
    state = SamplerState.create(sampler, scheduler, torch.tensor([800.0, 550.0]), x, returns=True)
    for step in range(2):
        s, s_next = float(sigmas[step]), float(sigmas[step + 1])
        g = 0.9 * math.sqrt(s / (1 - s))
        dt = s_next - s
        x0, noise = x - s * v, x + (1 - s) * v
        score_term = g * g / (2 * s) * noise
        expected_mean = x + (v + score_term) * dt
        assert x0.shape == expected_mean.shape
        following = state.step(x, v, step, generator)
        drawn = state.record["noise"][-1]
        std = g * math.sqrt(-dt)
        torch.testing.assert_close(following, expected_mean + std * drawn, atol=1e-6, rtol=0)
        normal: Any = torch.distributions.Normal(expected_mean.double(), std)
        density = normal.log_prob(following.double()).mean(dim=(1, 2)).float()
        torch.testing.assert_close(state.record["log_probs"][-1], density, atol=2e-6, rtol=0)
        x = following


@pytest.mark.parametrize("to_one", [False, True], ids=["sd", "alpha-to-one"])
def test_a_ddim_step_is_diffusers_ddim_with_that_noise(to_one: bool) -> None:
    """L100: DDIM with eta on SD's schedule: each step equals diffusers'
    ``DDIMScheduler.step`` given the same eta and noise (float32 rounding), and its
    log-probability is torch's Normal's at the next latent with DDIM's variance. A last
    step onto a cumulative alpha of 1 (``set_alpha_to_one``) has no variance and draws
    nothing; SD's own (``False``: onto the first alpha) draws."""
    from diffusers import DDIMScheduler

    from omni_trio.runners._sde import SamplerState, step_coefficients

    config = tiny("sd").scheduler.config
    ddim: Any = DDIMScheduler  # untyped
    reference = ddim.from_config(config, set_alpha_to_one=to_one)
    reference.set_timesteps(4)
    ours = ddim.from_config(config, set_alpha_to_one=to_one)
    ours.set_timesteps(4)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=generator)
    sampler = ot.DDIMSampler(eta=0.8)
    state = SamplerState.create(sampler, ours, ours.timesteps, x, returns=True)
    for step, t in enumerate(ours.timesteps):
        eps = torch.randn(1, 4, 8, 8, generator=generator)
        following = state.step(x, eps, step, generator)
        noise = state.record["noise"][-1] if state.record["steps"][-1:] == [step] else None
        expected = reference.step(eps, t, x, eta=0.8, variance_noise=noise, return_dict=False)[0]
        torch.testing.assert_close(following, expected, atol=1e-5, rtol=0)
        _, _, std = step_coefficients(sampler, "epsilon", state.schedule[step])
        if noise is not None:
            mean = following - std * noise
            normal: Any = torch.distributions.Normal(mean.double(), std)
            density = normal.log_prob(following.double()).mean().float()
            torch.testing.assert_close(state.record["log_probs"][-1][0], density, atol=2e-5, rtol=0)
        x = following
    assert state.record["steps"] == ([0, 1, 2] if to_one else [0, 1, 2, 3])


async def test_a_sampler_with_no_noisy_step_is_the_euler_ode() -> None:
    """L100: an SDE sampler that draws no noise (``steps=()``) takes the flow's Euler
    step: the images of the scheduler's own run, to the row-invariant layers' rounding;
    its trajectory has every latent and no transition."""
    plain = request("flux", seed=4)
    quiet = sampled("flux", seed=4, sampler=ot.SDESampler(steps=()))
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny("flux"))) as engine:
            expected = await engine.generate(plain)
            got = await engine.generate(quiet)
    torch.testing.assert_close(got.images, expected.images, atol=1e-5, rtol=0)
    trajectory = got.trajectory
    assert trajectory is not None
    assert trajectory.latents.shape[1] == 5 and trajectory.steps.numel() == 0
    assert trajectory.log_probs.shape == (1, 0)
    with pytest.raises(ValueError, match="drew no noise"):
        transition_log_prob(trajectory, 0, trajectory.latents[:, 0])


async def test_what_cannot_sample_so_refuses_the_sampler_by_name() -> None:
    """L100: the runner declares the samplers its family and scheduler run: the SDE for
    flow matching, DDIM for SD and SDXL; the unconditional UNet, LTX-Video, a fake
    runner, a sampler beside a step cache, and a trajectory without a sampler are
    refused naming their field."""
    declared = {}
    for kind in ("flux", "sd3", "qwen-image", "wan", "sd", "sdxl", "unet", "ltx"):
        runner = DiffusersRunner(tiny(kind))
        runner.close()
        declared[kind] = runner.capabilities.samplers
    assert declared == {
        **dict.fromkeys(["flux", "sd3", "qwen-image", "wan"], frozenset({"sde"})),
        "sd": frozenset({"ddim"}),
        "sdxl": frozenset({"ddim"}),
        "unet": frozenset(),
        "ltx": frozenset(),
    }
    flux = DiffusersRunner(tiny("flux"))
    flux.close()
    cases = [
        (flux.capabilities, request("flux", sampler=ot.DDIMSampler()), "'ddim'"),
        (
            flux.capabilities,
            request("flux", sampler=ot.SDESampler(), cache=ot.StepCache(kind="first-block")),
            "step cache",
        ),
        (FakeRunner().capabilities, ot.GenerationRequest(sampler=ot.SDESampler()), "none"),
    ]
    for capabilities, r, words in cases:
        with pytest.raises(ot.InvalidRequestError, match=words) as info:
            capabilities.check_request(r)
        assert info.value.field == "sampler"
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.InvalidRequestError) as info:
                engine.submit(ot.GenerationRequest(seed=1, sampler=ot.SDESampler()))
            assert info.value.field == "sampler"
    refused: dict[str, dict[str, Any]] = {
        "return_trajectory": {"return_trajectory": True},
        "sampler": {"sampler": ot.SDESampler(steps=(3,)), "num_steps": 3},
    }
    for field, fields in refused.items():
        with pytest.raises(ot.InvalidRequestError) as info:
            ot.GenerationRequest(**fields)
        assert info.value.field == field
    bad: dict[str, Any]
    for bad in ({"noise_level": 0}, {"noise_level": math.inf}, {"steps": (1, 1)}):
        with pytest.raises(ot.InvalidRequestError) as info:
            ot.SDESampler(**bad)
        assert info.value.field == "sampler"


async def test_a_result_cache_never_answers_a_request_for_its_trajectory() -> None:
    """L100, L95: a trajectory is never kept: a repeat that asks for one runs again (and
    equals the first bitwise); the same sampled request without it is kept and hit."""
    cache = ot.ResultCache(max_bytes=2**26)
    r = sampled("flux", seed=12)
    quiet = dataclasses.replace(r, return_trajectory=False)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(
            DiffusersRunner(tiny("flux")), ot.EngineConfig(result_cache=cache)
        ) as engine:
            first, again = await engine.generate(r), await engine.generate(r)
            kept, hit = await engine.generate(quiet), await engine.generate(quiet)
    assert not again.metrics.result_cache_hit
    assert_same(first, again)
    assert (kept.metrics.result_cache_hit, hit.metrics.result_cache_hit) == (False, True)
    assert hit.trajectory is None and torch.equal(hit.images, first.images)
