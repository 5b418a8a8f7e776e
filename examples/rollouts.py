"""Rollouts for RL post-training: groups of stochastic samples and their log-probabilities.

Two prompts, a group of four samples each, from a tiny Flux with the flow-matching SDE
sampler (L100): every sample returns its trajectory (each step's latents, the noise
drawn, the timesteps, each transition's log-probability). The groups are submitted
together, so the engine batches their samples (L101). Then a "trainer" does what
group-relative RL does: a reward per sample, advantages within each group, and each
transition's log-probability recomputed by calling the transformer itself on the
returned latents, which gives the rollout's values bit for bit. Last, the trainer's turn
(L102, L103): the engine sleeps while the trainer has the memory, wakes, takes the new
weights in place, and the next rollouts name the version they ran on.

The tiny model stands in for a real one: load ``black-forest-labs/FLUX.1-dev`` with
``omni_trio.runners.load(ModelSpec(...))`` instead, and the trainer's forward is the
same call with its own weights.

Usage: .venv/bin/python examples/rollouts.py   (a few seconds on a CPU)
"""

import dataclasses
from typing import Any

import anyio
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, row_invariant, tiny_pipeline, transition_log_prob

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]
GROUP = 4
SEED = 2026
REQUEST = ot.GenerationRequest(
    num_steps=6,
    height=64,
    width=64,
    guidance_scale=3.5,
    sampler=ot.SDESampler(noise_level=0.7),  # every step draws noise
    return_trajectory=True,
)


def reward(output: ot.GenerationOutput) -> float:
    """A toy reward: how red the image is (a trainer scores with a reward model)."""
    red, green, blue = output.images[0].mean(dim=(1, 2)).tolist()
    return float(red - (green + blue) / 2)


def velocity(pipe: Any, prompt: str, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The trainer's forward: Flux's transformer on a rollout's latents, at its timestep."""
    count = latents.shape[0]
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=prompt, prompt_2=None, num_images_per_prompt=count
    )
    channels = pipe.transformer.config.in_channels // 4
    unused = torch.Generator().manual_seed(0)
    _, image_ids = pipe.prepare_latents(1, channels, 64, 64, embeds.dtype, "cpu", unused)
    out: torch.Tensor = pipe.transformer(
        hidden_states=latents,
        timestep=t.expand(count) / 1000,
        guidance=torch.full([count], REQUEST.guidance_scale),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]
    return out


async def main() -> None:
    pipe = tiny_pipeline("flux")
    groups: dict[str, ot.GroupResult] = {}
    options = ot.EngineConfig(max_batch_size=len(PROMPTS) * GROUP)
    async with ot.open_engine(DiffusersRunner(pipe), options) as engine:

        async def rollout(index: int, prompt: str) -> None:
            # Each group's seed its own: its samples' seeds are derived from it.
            request = dataclasses.replace(REQUEST, prompt=prompt, seed=SEED + index)
            groups[prompt] = await ot.generate_group(engine, request, n=GROUP)

        async with anyio.create_task_group() as tasks:
            for index, prompt in enumerate(PROMPTS):
                tasks.start_soon(rollout, index, prompt)
        shared = engine.statistics()
        print(f"{shared.steps_run} sample-steps in {shared.batch_steps} batched model steps")
        recompute(pipe, groups)

        # The trainer's turn. Its update, here a small step of seeded noise, is made
        # before the sleep: asleep, the engine's weights are not where they were.
        generator = torch.Generator().manual_seed(SEED)
        trained = {
            name: value + 1e-3 * torch.randn(value.shape, generator=generator)
            for name, value in pipe.transformer.state_dict().items()
        }
        slept = await engine.sleep(1)  # the trainer has the memory meanwhile
        await engine.wake()
        await engine.update_weights(trained, label="step-1")
        request = dataclasses.replace(REQUEST, prompt=PROMPTS[0], seed=SEED)
        after = await ot.generate_group(engine, request, n=GROUP)
        version = after.outputs[0].weight_version
        print(f"slept with {slept.freed_bytes:,} bytes freed; the next rollouts ran on {version}")


def recompute(pipe: Any, groups: dict[str, ot.GroupResult]) -> None:
    """The trainer's side: rewards, advantages, and every log-probability recomputed."""
    worst, checked = 0.0, 0
    with torch.no_grad(), row_invariant(pipe.transformer):
        for prompt in PROMPTS:
            group = groups[prompt]
            rewards = torch.tensor([reward(output) for output in group.outputs])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            print(f"{prompt!r}: {len(group.outputs)} samples, partial: {group.is_partial}")
            for output, advantage in zip(group.outputs, advantages.tolist(), strict=True):
                trajectory = output.trajectory
                assert trajectory is not None
                for place, step in enumerate(trajectory.steps.tolist()):
                    latents = trajectory.latents[:, step]
                    prediction = velocity(pipe, prompt, latents, trajectory.timesteps[step])
                    mine = transition_log_prob(trajectory, step, prediction)
                    difference = (mine - trajectory.log_probs[:, place]).abs().max()
                    worst, checked = max(worst, float(difference)), checked + 1
                total = float(trajectory.log_probs.sum())
                print(f"  advantage {advantage:+.2f}  log-probability of its steps {total:+.4f}")
    print(f"trainer recomputed {checked} transitions: largest difference {worst}")


if __name__ == "__main__":
    anyio.run(main)
