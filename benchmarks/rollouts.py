"""``rollouts``: RL rollouts with the SDE sampler (L100, L101) vs diffusers' pipeline calls.

On the compute-bound Flux of the ``cache`` benchmark (``bench_flux``: 1 double and 3
single blocks of width 256, at 128 x 128 px), ``PROMPTS`` prompts x ``GROUP`` samples,
``STEPS`` steps, every step the flow-matching SDE (noise level 0.7), each sample's
trajectory and log-probabilities kept. Two arms, alternating, ``REPEATS`` times:

- ``engine``: every group through ``omni_trio.generate_group`` at once, on one engine
  (batches of ``GROUP``: the samples of all groups join and leave as they come);
- ``diffusers``: the way Flow-GRPO rolls out: the pipeline's own call once per group
  (``num_images_per_prompt=GROUP``, a generator per sample), its scheduler's step
  replaced by the same SDE step, recording each step's latents and log-probabilities.

Both draw each sample's noise from the sample's own generator with the same seeds, so
their samples are the same up to the batching's rounding. The figure is samples per
second, the engine's over the calls'. Then the trainer's side: every transition of the
engine's rollouts recomputed by calling the transformer on the returned latents, one
sample at a time, under ``row_invariant`` (the largest log-probability difference:
target 0 on a CPU in float32), and the same for the calls' rollouts without it (what a
trainer gets from a rollout whose batch it does not reproduce).

Then the weights' side (``rollouts_weights``): an update's latency and the running
samples' stall under each policy (L102); sleep and wake at both levels, and the first
output after the wake against one from before (L103).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import omni_trio as ot

from .cache import BENCH_SIZE, bench_flux
from .common import Options, fmt, md_table, spread
from .plot import PEER_COLORS, bar_with_range, figure
from .rollouts_weights import run_weights, table_weights

__all__ = ["plot_rollouts", "run_rollouts", "table_rollouts"]

PROMPTS = 8
GROUP = 8
STEPS = 10
REPEATS = 3
NOISE_LEVEL = 0.7
GUIDANCE = 3.5


def _request(index: int, steps: int) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a lighthouse, take {index}",
        num_steps=steps,
        height=BENCH_SIZE,
        width=BENCH_SIZE,
        guidance_scale=GUIDANCE,
        seed=1000 + index,
        sampler=ot.SDESampler(noise_level=NOISE_LEVEL),
        return_trajectory=True,
    )


async def _engine_arm(pipe: Any, requests: list[ot.GenerationRequest], group: int) -> Any:
    """Every group at once through one engine; the groups' results, in order."""
    import anyio

    from omni_trio.runners import DiffusersRunner

    results: list[Any] = [None] * len(requests)
    options = ot.EngineConfig(max_batch_size=group, max_waiting=len(requests) * group)
    async with ot.open_engine(DiffusersRunner(pipe, max_batch_size=group), options) as engine:

        async def one(index: int) -> None:
            results[index] = await ot.generate_group(engine, requests[index], n=group)

        async with anyio.create_task_group() as tasks:
            for index in range(len(requests)):
                tasks.start_soon(one, index)
    return results


def _sde_scheduler(pipe: Any, generators: list[Any], record: dict[str, list[Any]]) -> Any:
    """A copy of ``pipe``'s scheduler whose step is the SDE step, each row's noise from its
    own generator, recording the latents and log-probabilities (as Flow-GRPO patches it)."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    from omni_trio.runners._sde import log_density, step_coefficients

    sampler = ot.SDESampler(noise_level=NOISE_LEVEL)
    base = type(pipe.scheduler)

    class SDEScheduler(base):  # type: ignore[misc, valid-type]
        def step(self, model_output: Any, timestep: Any, sample: Any, **_: Any) -> Any:
            if self.step_index is None:
                self._init_step_index(timestep)
            index = self.step_index
            row = torch.stack([self.sigmas[index], self.sigmas[index + 1]]).float()
            cx, cp, std = step_coefficients(sampler, "flow", row)
            mean = sample.float() * cx + model_output.float() * cp
            noise = torch.cat(
                [
                    randn_tensor((1, *mean.shape[1:]), generator=g, dtype=torch.float32)
                    for g in generators
                ]
            )
            following = (mean + noise * std).to(sample.dtype)
            if not record["latents"]:
                record["latents"].append(sample.float().clone())
            record["timesteps"].append(timestep)
            record["schedule"].append(row)
            record["latents"].append(following.float().clone())
            record["log_probs"].append(log_density(following, mean, std))
            self._step_index += 1
            return (following,)

    return SDEScheduler.from_config(pipe.scheduler.config)


def _calls_arm(pipe: Any, requests: list[ot.GenerationRequest], group: int) -> list[Any]:
    """One pipeline call per group; each group's record: latents, log-probabilities."""
    import torch

    records = []
    original = pipe.scheduler
    try:
        for request in requests:
            assert request.seed is not None
            generators = [
                torch.Generator().manual_seed(seed) for seed in ot.group_seeds(request.seed, group)
            ]
            record: dict[str, list[Any]] = {
                "latents": [],
                "log_probs": [],
                "timesteps": [],
                "schedule": [],
            }
            pipe.scheduler = _sde_scheduler(pipe, generators, record)
            pipe(
                request.prompt,
                num_inference_steps=request.num_steps,
                height=request.height,
                width=request.width,
                guidance_scale=request.guidance_scale,
                num_images_per_prompt=group,
                generator=generators,
                output_type="pt",
            )
            records.append(record)
    finally:
        pipe.scheduler = original
    return records


def _velocity(pipe: Any, prompt: str, latents: Any, t: Any) -> Any:
    """The trainer's forward: the transformer on ``latents`` at timestep ``t``."""
    import torch

    count = latents.shape[0]
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=prompt, prompt_2=None, num_images_per_prompt=count
    )
    channels = pipe.transformer.config.in_channels // 4
    unused = torch.Generator().manual_seed(0)
    _, image_ids = pipe.prepare_latents(
        1, channels, BENCH_SIZE, BENCH_SIZE, embeds.dtype, "cpu", unused
    )
    return pipe.transformer(
        hidden_states=latents,
        timestep=t.expand(count) / 1000,
        guidance=torch.full([count], GUIDANCE),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids,
        img_ids=image_ids,
        return_dict=False,
    )[0]


def _engine_mismatch(pipe: Any, requests: list[ot.GenerationRequest], groups: list[Any]) -> Any:
    """The largest |recomputed - reported| over every transition of the engine's samples,
    each recomputed alone under ``row_invariant``; and how many."""
    import torch

    from omni_trio.runners import row_invariant, transition_log_prob

    worst, count = 0.0, 0
    with torch.no_grad(), row_invariant(pipe.transformer):
        for request, group in zip(requests, groups, strict=True):
            for output in group.outputs:
                trajectory = output.trajectory
                for place, step in enumerate(trajectory.steps.tolist()):
                    latents = trajectory.latents[:, step]
                    prediction = _velocity(
                        pipe, request.prompt, latents, trajectory.timesteps[step]
                    )
                    mine = transition_log_prob(trajectory, step, prediction)
                    difference = (mine - trajectory.log_probs[:, place]).abs().max()
                    worst, count = max(worst, float(difference)), count + 1
    return worst, count


def _calls_mismatch(pipe: Any, requests: list[ot.GenerationRequest], records: list[Any]) -> Any:
    """The same for the calls' rollouts, each sample recomputed alone, no padding."""
    import torch

    from omni_trio.runners._sde import log_density, step_coefficients

    sampler = ot.SDESampler(noise_level=NOISE_LEVEL)
    worst, count = 0.0, 0
    with torch.no_grad():
        for request, record in zip(requests, records, strict=True):
            for step in range(request.num_steps):
                cx, cp, std = step_coefficients(sampler, "flow", record["schedule"][step])
                for sample in range(record["latents"][0].shape[0]):
                    x = record["latents"][step][sample : sample + 1]
                    following = record["latents"][step + 1][sample : sample + 1]
                    t = record["timesteps"][step].reshape(-1)[:1]
                    prediction = _velocity(pipe, request.prompt, x, t)
                    mean = x * cx + prediction.float() * cp
                    mine = log_density(following, mean, std)
                    reported = record["log_probs"][step][sample]
                    worst, count = max(worst, float((mine[0] - reported).abs())), count + 1
    return worst, count


def run_rollouts(options: Options) -> dict[str, Any]:
    """The two arms, alternating; then the trainer's recomputation of both."""
    quick = options.quick
    prompts, group = (2, 2) if quick else (PROMPTS, GROUP)
    steps, repeats = (3, 1) if quick else (STEPS, REPEATS)
    pipe = bench_flux()
    requests = [_request(index, steps) for index in range(prompts)]
    samples = prompts * group
    options.run(_engine_arm, pipe, requests[:1], 1)  # warm-up of both
    _calls_arm(pipe, requests[:1], 1)
    wall: dict[str, list[float]] = {"engine": [], "calls": []}
    cpu: dict[str, list[float]] = {"engine": [], "calls": []}
    groups: Any = None
    records: Any = None
    for repeat in range(repeats):
        for arm in ("engine", "calls") if repeat % 2 == 0 else ("calls", "engine"):
            # The process's CPU time: every thread's (the engine's worker and
            # materializer too), so other processes' turns on a shared machine are out.
            started, used = time.perf_counter(), time.process_time()
            if arm == "engine":
                groups = options.run(_engine_arm, pipe, requests, group)
            else:
                records = _calls_arm(pipe, requests, group)
            wall[arm].append(time.perf_counter() - started)
            cpu[arm].append(time.process_time() - used)
    engine_s, calls_s = wall["engine"], wall["calls"]
    partial = sum(result.is_partial for result in groups)
    engine_worst, engine_checked = _engine_mismatch(pipe, requests, groups)
    calls_worst, calls_checked = _calls_mismatch(pipe, requests, records)
    # The two arms' samples: the same seeds and noise, to the batching's rounding.
    first = groups[0].outputs[0].trajectory
    arms_differ = float((first.latents[0, -1] - records[0]["latents"][-1][0]).abs().max())
    weights = run_weights(options.run, requests[0], quick=quick)
    ratios = [calls / engine for engine, calls in zip(engine_s, calls_s, strict=True)]
    cpu_ratios = [c / e for e, c in zip(cpu["engine"], cpu["calls"], strict=True)]
    return {
        "config": {
            "prompts": prompts,
            "group": group,
            "steps": steps,
            "repeats": repeats,
            "noise_level": NOISE_LEVEL,
            "bench_flux": (
                "1 double + 3 single blocks, 4 heads of 64, 128 px (64 image, 512 text tokens)"
            ),
            "weights": "random (seeded)",
        },
        "engine_s": spread(engine_s),
        "calls_s": spread(calls_s),
        "engine_cpu_s": spread(cpu["engine"]),
        "calls_cpu_s": spread(cpu["calls"]),
        "cpu_ratios": cpu_ratios,
        "engine_samples_per_s": samples / statistics.median(engine_s),
        "calls_samples_per_s": samples / statistics.median(calls_s),
        "ratios": ratios,
        "trajectory_bytes": int(first.latents.nbytes + first.noise.nbytes + first.log_probs.nbytes),
        "weights": weights,
        "summary": {
            "throughput_ratio_engine_over_calls": statistics.median(ratios),
            "cpu_ratio_engine_over_calls": statistics.median(cpu_ratios),
            "engine_logprob_mismatch": engine_worst,
            "engine_transitions_checked": engine_checked,
            "calls_logprob_mismatch": calls_worst,
            "calls_transitions_checked": calls_checked,
            "partial_groups": partial,
            "arms_max_latent_diff": arms_differ,
            **weights["summary"],
        },
    }


def table_rollouts(result: dict[str, Any]) -> str:
    """Samples per second of both arms; the trainer's log-probability mismatch."""
    config, summary = result["config"], result["summary"]
    parts = [
        f"{config['prompts']} prompts x {config['group']} samples, {config['steps']} SDE steps"
        f" (noise level {config['noise_level']}), compute-bound Flux ({config['bench_flux']}),"
        f" {config['weights']} weights; medians of {config['repeats']} alternating runs:\n",
        md_table(
            ["arm", "samples/s", "wall s (median)", "min", "max", "CPU s (median)"],
            [
                [
                    label,
                    fmt(result[f"{arm}_samples_per_s"], 2),
                    fmt(result[f"{arm}_s"]["median"], 2),
                    fmt(result[f"{arm}_s"]["min"], 2),
                    fmt(result[f"{arm}_s"]["max"], 2),
                    fmt(result[f"{arm}_cpu_s"]["median"], 2),
                ]
                for arm, label in (
                    ("engine", "omni_trio: generate_group, every group at once"),
                    ("calls", "diffusers: one pipeline call per group, SDE step patched in"),
                )
            ],
        ),
        "\nThroughput, omni_trio over the calls:"
        f" {summary['throughput_ratio_engine_over_calls']:.2f}x (median of the pairs' wall-time"
        " ratios; of their CPU time, in every thread of the process:"
        f" {summary['cpu_ratio_engine_over_calls']:.2f}x).\n",
        "\n**The trainer's recomputation** (every transition, each sample alone: the"
        " transformer called on the returned latents):\n",
        md_table(
            ["rollouts", "transitions", "largest log-probability difference"],
            [
                [
                    "omni_trio, trainer under row_invariant",
                    str(summary["engine_transitions_checked"]),
                    f"{summary['engine_logprob_mismatch']:.3g}",
                ],
                [
                    "pipeline calls (batch of a group), trainer alone",
                    str(summary["calls_transitions_checked"]),
                    f"{summary['calls_logprob_mismatch']:.3g}",
                ],
            ],
        ),
        f"\nThe two arms' first sample ends within {summary['arms_max_latent_diff']:.2g} of each"
        f" other (same seeds and noise); a trajectory is {result['trajectory_bytes']:,} bytes;"
        f" partial groups: {summary['partial_groups']}.",
        table_weights(result["weights"]),
    ]
    return "\n".join(parts)


def plot_rollouts(result: dict[str, Any], path: Path) -> None:
    """Wall time of the whole rollout per arm."""
    with figure(path, title="rollouts: groups with the SDE sampler") as (ax,):
        bar_with_range(
            ax,
            ["omni_trio\ngenerate_group", "diffusers\ncall per group"],
            [result["engine_s"], result["calls_s"]],
            colors=[PEER_COLORS["omni_trio"], PEER_COLORS["naive"]],
            ylabel="s for all samples",
        )
