"""``cache``: per-request step caching (L80-L84) against no cache and diffusers' own hook.

Four parts, each on random-weight models (whose residual dynamics are not a real
checkpoint's: the figures say what the mechanism does, not what quality a trained
model keeps at a threshold):

- **quality** on the tiny DiT families (Flux, SD3, Wan, Qwen-Image), ``STEPS`` steps,
  a threshold sweep: the fraction of block work done (row-blocks computed over all)
  and the PSNR of the decoded output against the uncached one. TaylorSeer beside it.
- **batch invariance**: the same cached request alone and in a batch of up to 4 whose
  other members (other prompts, seeds, steps, guidance, image counts, policies) join
  and leave at random boundaries, over seeded schedules: the count of decisions that
  differ from the solo run (target 0), and the largest output difference. diffusers'
  hook beside it: one decision per model call for the whole batch, so in a batch of
  two prompts each prompt's rows are counted against its own solo run.
- **wall time** on a compute-bound Flux (``bench_flux``: wider and deeper than the tiny
  one; its step is mostly matrix products, not Python): a request alone, cached at
  each threshold vs uncached, interleaved, medians of ``REPEATS``; the same for
  diffusers' ``FirstBlockCacheConfig`` on a pipeline of its own (its call vs the plain
  call), side by side: their speedup, their skips, their PSNR.
- **bookkeeping** when nothing skips: threshold 0 (every residual, ratio and tail kept,
  one host sync per call) against no policy, step by step, interleaved, on the
  compute-bound Flux and on tiny Flux.
"""

from __future__ import annotations

import importlib
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import omni_trio as ot

from .common import fmt, md_table, shared_pipeline, spread
from .plot import PEER_COLORS, figure

__all__ = [
    "bench_flux",
    "churned",
    "company",
    "diffusers_decisions",
    "plot_cache",
    "run_cache",
    "stepped",
    "table_cache",
]

#: The tiny DiT families of the quality and invariance parts.
FAMILIES = ("flux", "sd3", "wan", "qwen-image")
#: The thresholds swept (the tiny models' change ratios are 0.2-0.5 per step: below 0.2
#: they never skip, which is the point of sweeping from 0.02).
THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 0.8)
#: The thresholds timed, ours and diffusers' (the compute-bound Flux's change ratios are
#: 0.4-0.6 a step: it computes every call below 0.4).
TIMED = (0.2, 0.4, 0.5, 0.55, 0.6, 0.8)
STEPS = 30
REPEATS = 3
SCHEDULES = 4
#: Steps of the bookkeeping comparison, each way.
BOOKKEEPING_STEPS = 100


def _size(kind: str) -> dict[str, Any]:
    if kind in ("wan", "ltx"):
        return {"height": 32, "width": 32, "num_frames": 9}
    return {"height": 64, "width": 64}


def request_of(kind: str, **fields: Any) -> ot.GenerationRequest:
    """The benchmark's request for ``kind`` (guided, one image): ``fields`` override."""
    values: dict[str, Any] = {
        "prompt": "a lighthouse on a cliff at dusk",
        "num_steps": STEPS,
        "guidance_scale": 3.5,
        "seed": 1,
        **_size(kind),
    }
    if kind in ("wan", "ltx"):
        values["negative_prompt"] = "dull"
    return ot.GenerationRequest(**{**values, **fields})


def stepped(runner: Any, r: ot.GenerationRequest) -> tuple[Any, ot.CacheMetrics | None]:
    """``r`` stepped alone on ``runner``: its decoded output and its cache metrics."""
    state = runner.prepare(r, "alone")
    for _ in range(r.denoise_steps):
        runner.step([state])
    return _finished(runner, state)


def _finished(runner: Any, state: Any) -> tuple[Any, ot.CacheMetrics | None]:
    output, metrics = runner.decode(state), runner.cache_metrics(state)
    runner.discard(state)
    return output, metrics


def company(kind: str, rng: random.Random, number: int) -> ot.GenerationRequest:
    """Another request of ``kind``'s batch key: its own prompt, seed, steps, guidance, policy."""
    policy = rng.choice(
        [
            None,
            ot.StepCache(kind="first-block", threshold=rng.choice([0.2, 0.5, 0.9])),
            ot.StepCache(kind="taylorseer", interval=2),
        ]
    )
    negative = {} if kind == "flux" else {"negative_prompt": rng.choice([None, "dull, grey"])}
    return request_of(
        kind,
        prompt=f"company {number}" + ", longer" * rng.randint(0, 3),
        num_steps=rng.randint(2, 8),
        seed=100 + number,
        guidance_scale=rng.choice([1.0, 4.0]),
        num_images=rng.choice([1, 2]),
        cache=policy,
        **negative,
    )


def churned(
    runner: Any,
    r: ot.GenerationRequest,
    rng: random.Random,
    make: Callable[[random.Random, int], ot.GenerationRequest],
    *,
    most: int = 4,
) -> tuple[Any, ot.CacheMetrics | None]:
    """``r`` stepped in a batch of up to ``most`` whose other members join and leave.

    Before each step, each member leaves when it finished or with probability 0.2
    (an abort), and new ones (``make(rng, n)``) join with probability 0.6 each while
    there is room; ``r`` sits anywhere in the batch.
    """
    state = runner.prepare(r, "target")
    members: list[tuple[Any, int]] = []  # (state, steps left)
    joined = 0
    for _ in range(r.denoise_steps):
        for member in list(members):
            if member[1] == 0 or rng.random() < 0.2:
                runner.discard(member[0])
                members.remove(member)
        while len(members) < most - 1 and rng.random() < 0.6:
            other = make(rng, joined)
            joined += 1
            members.append((runner.prepare(other, f"company-{joined}"), other.denoise_steps))
        states = [member[0] for member in members]
        states.insert(rng.randint(0, len(states)), state)
        runner.step(states)
        members = [(member, left - 1) for member, left in members]
    for member_state, _ in members:
        runner.discard(member_state)
    return _finished(runner, state)


@contextmanager
def diffusers_decisions() -> Iterator[list[tuple[str, bool]]]:
    """Note diffusers' FirstBlockCache decisions inside: (cache context, computed) per call.

    One decision per model call for the whole batch: its head hook's
    ``_should_compute_remaining_blocks``, observed (the method is wrapped, then put back).
    """
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    noted: list[tuple[str, bool]] = []
    original = FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self: Any, residual: Any) -> bool:
        computes = bool(original(self, residual))
        noted.append((self.state_manager.context.name, computes))
        return computes

    FBCHeadBlockHook._should_compute_remaining_blocks = spy  # type: ignore[method-assign]
    try:
        yield noted
    finally:
        FBCHeadBlockHook._should_compute_remaining_blocks = original  # type: ignore[method-assign]


def psnr(output: Any, reference: Any) -> float:
    """PSNR in dB of ``output`` against ``reference`` (both in [0, 1]); inf when equal."""
    mse = float(((output.float() - reference.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def _first_block(threshold: float) -> ot.StepCache:
    return ot.StepCache(kind="first-block", threshold=threshold)


def _pattern_text(metrics: ot.CacheMetrics | None) -> str:
    return "" if metrics is None else " ".join(metrics.pattern)


def _quality(kind: str, steps: int, thresholds: tuple[float, ...]) -> dict[str, Any]:
    """Block work and PSNR against uncached, per threshold (and TaylorSeer), on tiny ``kind``."""
    from omni_trio.runners import DiffusersRunner

    runner = DiffusersRunner(shared_pipeline(kind))
    try:
        uncached, _ = stepped(runner, request_of(kind, num_steps=steps))
        rows: list[dict[str, Any]] = []
        policies = [(f"first-block {t:g}", _first_block(t)) for t in thresholds]
        policies.append(
            ("taylorseer 3, order 2", ot.StepCache(kind="taylorseer", interval=3, order=2))
        )
        for label, policy in policies:
            output, metrics = stepped(runner, request_of(kind, num_steps=steps, cache=policy))
            assert metrics is not None
            rows.append(
                {
                    "policy": label,
                    "threshold": policy.threshold,
                    "block_fraction": metrics.block_fraction,
                    "calls_skipped": metrics.calls_skipped,
                    "calls": metrics.calls_computed + metrics.calls_skipped,
                    "psnr_db": psnr(output, uncached),
                    "pattern": _pattern_text(metrics),
                }
            )
    finally:
        runner.close()
    return {"kind": kind, "steps": steps, "rows": rows}


def _invariance(kind: str, steps: int, threshold: float, schedules: int) -> dict[str, Any]:
    """Differing decisions of one cached request, alone vs in churning batches of up to 4."""
    from omni_trio.runners import DiffusersRunner

    runner = DiffusersRunner(shared_pipeline(kind), max_batch_size=4)
    r = request_of(kind, num_steps=steps, seed=11, cache=_first_block(threshold))
    differing = decisions = 0
    worst = 0.0
    try:
        solo, metrics = stepped(runner, r)
        assert metrics is not None
        for seed in range(schedules):
            rng = random.Random(seed)
            output, churn = churned(runner, r, rng, lambda g, n: company(kind, g, n))
            assert churn is not None
            for ours, theirs in zip(metrics.pattern, churn.pattern, strict=True):
                differing += sum(a != b for a, b in zip(ours, theirs, strict=True))
                decisions += len(ours)
            worst = max(worst, float((output - solo).abs().max()))
    finally:
        runner.close()
    return {
        "kind": kind,
        "threshold": threshold,
        "schedules": schedules,
        "decisions": decisions,
        "differing": differing,
        "skipped_solo": metrics.calls_skipped,
        "max_abs_diff": worst,
    }


def _called(pipe: Any, kind: str, r: ot.GenerationRequest, prompts: Any = None) -> Any:
    """The pipeline's own call for ``r`` (``prompts``: several, a batch of prompts)."""
    import torch

    options: dict[str, Any] = {}
    if r.num_frames is not None:
        options = {"num_frames": r.num_frames, "negative_prompt": r.negative_prompt}
    out = pipe(
        prompts if prompts is not None else r.prompt,
        num_inference_steps=r.num_steps,
        height=r.height,
        width=r.width,
        guidance_scale=r.guidance_scale,
        generator=torch.Generator().manual_seed(r.seed or 0),
        output_type="pt",
        **options,
    )
    return out.images if r.num_frames is None else out.frames


def _hooked(make: Callable[[], Any], threshold: float) -> Any:
    """A pipeline of its own with diffusers' FirstBlockCacheConfig on its transformer."""
    from diffusers.hooks.first_block_cache import FirstBlockCacheConfig

    pipe = make()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    return pipe


def _theirs_in_a_batch(kind: str, steps: int, threshold: float) -> dict[str, Any]:
    """diffusers' hook: each of two prompts alone, then both in one call (one decision)."""
    from omni_trio.runners import DiffusersRunner, tiny_pipeline

    prompts = ["a lighthouse on a cliff at dusk", "a red fox in the snow"]
    solo: list[str] = []
    for prompt in prompts:
        with diffusers_decisions() as noted:
            _called(
                _hooked(lambda: tiny_pipeline(kind), threshold),
                kind,
                request_of(kind, num_steps=steps, prompt=prompt),
            )
        solo.append("".join("C" if c else "S" for _, c in noted))
    with diffusers_decisions() as noted:
        _called(
            _hooked(lambda: tiny_pipeline(kind), threshold),
            kind,
            request_of(kind, num_steps=steps),
            prompts,
        )
    batch = "".join("C" if c else "S" for _, c in noted)
    theirs = sum(a != b for pattern in solo for a, b in zip(pattern, batch, strict=True))
    # Ours on the same two prompts, one batch of both: each row against its own solo run.
    runner = DiffusersRunner(shared_pipeline(kind), max_batch_size=2)
    try:
        alone = []
        states = []
        for index, prompt in enumerate(prompts):
            r = request_of(kind, num_steps=steps, prompt=prompt, cache=_first_block(threshold))
            _, metrics = stepped(runner, r)
            assert metrics is not None
            alone.append(metrics.pattern[0])
            states.append(runner.prepare(r, f"both-{index}"))
        for _ in range(steps):
            runner.step(states)
        together = []
        for state in states:
            _, metrics = _finished(runner, state)
            assert metrics is not None
            together.append(metrics.pattern[0])
    finally:
        runner.close()
    ours = sum(
        a != b for x, y in zip(alone, together, strict=True) for a, b in zip(x, y, strict=True)
    )
    return {
        "kind": kind,
        "threshold": threshold,
        "decisions": 2 * steps,
        "theirs_differing": theirs,
        "theirs_solo": solo,
        "theirs_batch": batch,
        "ours_differing": ours,
        "ours_solo": alone,
        "ours_batch": together,
    }


def bench_flux() -> Any:
    """A Flux pipeline made compute-bound: 1 double and 3 single blocks of width 256.

    The tiny Flux's text encoders, tokenizers, VAE and scheduler; the transformer wider
    (4 heads of 64) and deeper (4 blocks), with seeded random weights (each call builds
    the same one anew: diffusers' hooks go on a pipeline of their own): at 128 x 128 px
    a step is 64 image tokens and 512 text tokens through products of width 256-1024.
    """
    import torch

    diffusers: Any = importlib.import_module("diffusers")  # untyped constructors
    base = shared_pipeline("flux")
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=3,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=32,  # the tiny T5's d_model
        pooled_projection_dim=32,  # the tiny CLIP's hidden size
        guidance_embeds=True,
        axes_dims_rope=(16, 24, 24),
    ).eval()
    pipe = diffusers.FluxPipeline(**{**base.components, "transformer": transformer})
    pipe.set_progress_bar_config(disable=True)  # as the tiny ones: no bar in the timings
    return pipe


BENCH_SIZE = 128


def _tiny_flux() -> Any:
    """A tiny Flux of its own (the same seeded weights as the shared one)."""
    from omni_trio.runners import tiny_pipeline

    return tiny_pipeline("flux")


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def _clocked(call: Callable[[], Any]) -> tuple[float, float]:
    """``call()``'s wall time and this thread's CPU time, in seconds.

    With one torch thread every kernel runs in this thread, so its CPU time is the
    work done; on a shared machine the wall time also counts other processes' turns.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _paired(
    uncached: Callable[[], Any], cached: Callable[[], Any], repeat: int
) -> tuple[float, float]:
    """One cached run over the uncached run next to it (the order alternating): wall, CPU."""
    if repeat % 2:
        cached_t = _clocked(cached)
        uncached_t = _clocked(uncached)
    else:
        uncached_t = _clocked(uncached)
        cached_t = _clocked(cached)
    return cached_t[0] / uncached_t[0], cached_t[1] / uncached_t[1]


def _wall(
    make: Callable[[], Any], label: str, steps: int, thresholds: tuple[float, ...], repeats: int
) -> dict[str, Any]:
    """Ours vs uncached and diffusers' hook vs its plain call, alone, on ``make()``.

    Each cached run is timed next to an uncached one (the order alternating), and the
    figures are the medians of those pairs' ratios, of wall time and of this thread's
    CPU time: on a shared machine, a run's neighbour in time is its fairest peer, and
    the CPU time leaves out the other processes' turns.
    """
    from omni_trio.runners import DiffusersRunner

    size = {"height": BENCH_SIZE, "width": BENCH_SIZE} if label != "tiny flux" else {}
    base = request_of("flux", num_steps=steps, **size)
    runner = DiffusersRunner(make())
    plain = make()  # diffusers' calls get pipelines of their own (its hooks stay on them)
    rows = []
    try:
        stepped(runner, base)  # warm-up
        uncached_s, (uncached, _) = _timed(lambda: stepped(runner, base))
        theirs_uncached_s, reference = _timed(lambda: _called(plain, "flux", base))
        for t in thresholds:
            cached = ot.GenerationRequest(**{**_fields(base), "cache": _first_block(t)})
            hooked = _hooked(make, t)
            ours_output, metrics = stepped(runner, cached)
            theirs_output, theirs_pattern = _theirs_call(hooked, base)
            assert metrics is not None
            ours = [
                _paired(partial(stepped, runner, base), partial(stepped, runner, cached), i)
                for i in range(repeats)
            ]
            theirs = [
                _paired(
                    partial(_called, plain, "flux", base), partial(_theirs_call, hooked, base), i
                )
                for i in range(repeats)
            ]
            rows.append(
                {
                    "threshold": t,
                    "ours_block_fraction": metrics.block_fraction,
                    "ours_skipped": metrics.calls_skipped,
                    "ours_wall_ratio": statistics.median(wall for wall, _ in ours),
                    "ours_cpu_ratio": statistics.median(cpu for _, cpu in ours),
                    "ours_ratios": ours,
                    "ours_psnr_db": psnr(ours_output, uncached),
                    "theirs_skipped": theirs_pattern.count("S"),
                    "theirs_wall_ratio": statistics.median(wall for wall, _ in theirs),
                    "theirs_cpu_ratio": statistics.median(cpu for _, cpu in theirs),
                    "theirs_ratios": theirs,
                    "theirs_psnr_db": psnr(theirs_output, reference),
                    "same_pattern": metrics.pattern[0] == theirs_pattern,
                }
            )
    finally:
        runner.close()
    return {
        "model": label,
        "steps": steps,
        "repeats": repeats,
        "uncached_s": uncached_s,
        "theirs_uncached_s": theirs_uncached_s,
        "rows": rows,
    }


def _fields(r: ot.GenerationRequest) -> dict[str, Any]:
    return {name: getattr(r, name) for name in ot.GenerationRequest.__dataclass_fields__}


def _theirs_call(pipe: Any, r: ot.GenerationRequest) -> tuple[Any, str]:
    with diffusers_decisions() as noted:
        output = _called(pipe, "flux", r)
    return output, "".join("C" if c else "S" for _, c in noted)


def _bookkeeping(make: Callable[[], Any], label: str, steps: int) -> dict[str, Any]:
    """What a policy that never skips (threshold 0) adds to a step, against no policy.

    Two requests of one runner stepped in turn, one step each, the order alternating;
    the figure is the median of each pair's difference of this thread's CPU time over
    the median step without a policy (a pair's two steps are neighbours in time, and
    the CPU time leaves out other processes' turns; the wall time is beside it).
    """
    from omni_trio.runners import DiffusersRunner

    size = {"height": BENCH_SIZE, "width": BENCH_SIZE} if label != "tiny flux" else {}
    runner = DiffusersRunner(make())
    none = runner.prepare(request_of("flux", num_steps=steps + 1, **size), "none")
    zero = runner.prepare(
        request_of("flux", num_steps=steps + 1, cache=_first_block(0.0), **size), "zero"
    )
    times: dict[str, list[tuple[float, float]]] = {"none": [], "zero": []}
    try:
        for state in (none, zero):
            runner.step([state])  # warm-up
        for i in range(steps):
            pair = [("none", none), ("zero", zero)]
            for name, state in pair if i % 2 == 0 else pair[::-1]:
                times[name].append(_clocked(partial(runner.step, [state])))
        for state in (none, zero):
            runner.discard(state)
    finally:
        runner.close()
    figures: dict[str, Any] = {"model": label, "steps": steps}
    for clock, index in (("cpu", 1), ("wall", 0)):
        plain = [t[index] for t in times["none"]]
        differences = [
            z[index] - n[index] for z, n in zip(times["zero"], times["none"], strict=True)
        ]
        added = statistics.median(differences)
        figures[f"{clock}_none_step_ms"] = spread([t * 1e3 for t in plain])
        figures[f"{clock}_added_us"] = added * 1e6
        figures[f"{clock}_cost_pct"] = added / statistics.median(plain) * 100
    return figures


def run_cache(options: Any) -> dict[str, Any]:
    """The four parts (see the module doc); ``--quick``: one family, two thresholds, 6 steps."""
    quick = options.quick
    steps = 6 if quick else STEPS
    families = ("flux",) if quick else FAMILIES
    thresholds = (0.4, 0.8) if quick else THRESHOLDS
    timed = (0.4,) if quick else TIMED
    repeats = 1 if quick else REPEATS
    schedules = 1 if quick else SCHEDULES
    quality = [_quality(kind, steps, thresholds) for kind in families]
    invariance = [_invariance(kind, steps, 0.35, schedules) for kind in families]
    against = [_theirs_in_a_batch("flux", steps, t) for t in ((0.4,) if quick else (0.3, 0.4, 0.6))]
    wall = [_wall(_tiny_flux, "tiny flux", steps, timed, repeats)]
    if not quick:
        wall.append(_wall(bench_flux, "compute-bound flux", 20, timed, repeats))
    bookkeeping = [
        _bookkeeping(
            lambda: shared_pipeline("flux"), "tiny flux", 10 if quick else BOOKKEEPING_STEPS
        )
    ]
    if not quick:
        bookkeeping.append(_bookkeeping(bench_flux, "compute-bound flux", BOOKKEEPING_STEPS))
    return {
        "config": {
            "families": list(families),
            "steps": steps,
            "thresholds": list(thresholds),
            "timed": list(timed),
            "repeats": repeats,
            "schedules": schedules,
            "bench_flux": (
                "1 double + 3 single blocks, 4 heads of 64, 128 px (64 image, 512 text tokens)"
            ),
            "weights": "random (seeded): residual dynamics unlike a trained checkpoint's",
        },
        "quality": quality,
        "invariance": invariance,
        "against_diffusers": against,
        "wall": wall,
        "bookkeeping": bookkeeping,
        "summary": _summary(invariance, against, wall, bookkeeping),
    }


def _summary(
    invariance: list[dict[str, Any]],
    against: list[dict[str, Any]],
    wall: list[dict[str, Any]],
    bookkeeping: list[dict[str, Any]],
) -> dict[str, Any]:
    largest = wall[-1]
    # The loosest threshold whose output keeps PSNR >= 30 dB on the largest model.
    kept = [row for row in largest["rows"] if row["ours_psnr_db"] >= 30] or largest["rows"][:1]
    best = min(kept, key=lambda row: row["ours_wall_ratio"])
    return {
        "differing_decisions": sum(item["differing"] for item in invariance),
        "decisions_compared": sum(item["decisions"] for item in invariance),
        "theirs_differing_in_a_batch_of_2": sum(item["theirs_differing"] for item in against),
        "ours_differing_in_a_batch_of_2": sum(item["ours_differing"] for item in against),
        "best_threshold": best["threshold"],
        "best_block_fraction": best["ours_block_fraction"],
        "best_wall_ratio": best["ours_wall_ratio"],
        "best_cpu_ratio": best["ours_cpu_ratio"],
        "theirs_cpu_ratio_at_best": best["theirs_cpu_ratio"],
        "best_psnr_db": best["ours_psnr_db"],
        "theirs_wall_ratio_at_best": best["theirs_wall_ratio"],
        "bookkeeping_pct": bookkeeping[-1]["cpu_cost_pct"],
        "bookkeeping_wall_pct": bookkeeping[-1]["wall_cost_pct"],
        "bookkeeping_us": bookkeeping[-1]["cpu_added_us"],
        "solo_patterns_unlike_diffusers": sum(
            not row["same_pattern"] for item in wall for row in item["rows"]
        ),
    }


def _db(value: float) -> str:
    return "∞" if math.isinf(value) else fmt(value, 1)


def table_cache(result: dict[str, Any]) -> str:
    """The four parts' tables, with the caveat of random weights first."""
    config = result["config"]
    parts = [
        "Random-weight models: their first-block change ratios (0.2-0.5 a step on the tiny"
        " ones) are not a trained checkpoint's (diffusers' default threshold is 0.05), so a"
        " threshold here is not one to use on a real model; what the figures show is the"
        " mechanism: how much work a threshold skips, what it costs, and that a request's"
        " decisions do not depend on its batch.\n",
        f"**Block work and PSNR vs uncached** ({config['steps']} steps, tiny models, alone):\n",
    ]
    rows = [
        [
            item["kind"],
            row["policy"],
            f"{row['calls_skipped']}/{row['calls']}",
            fmt(row["block_fraction"] * 100, 0) + " %",
            _db(row["psnr_db"]),
        ]
        for item in result["quality"]
        for row in item["rows"]
    ]
    parts.append(md_table(["family", "policy", "row-calls skipped", "block work", "PSNR dB"], rows))
    parts.append(
        "\n**Batch invariance**: the same request (first-block 0.35) alone and in batches of up"
        f" to 4 with members joining and leaving at random steps, {config['schedules']} seeded"
        " schedules each:\n"
    )
    rows = [
        [
            item["kind"],
            f"{item['differing']} of {item['decisions']}",
            str(item["skipped_solo"]),
            f"{item['max_abs_diff']:.1e}",
        ]
        for item in result["invariance"]
    ]
    parts.append(
        md_table(["family", "differing decisions", "skipped alone", "max |output diff|"], rows)
    )
    parts.append(
        "\n**diffusers' hook in a batch**: two prompts alone, then both in one call (tiny"
        " Flux); each prompt's decisions against its own solo run. diffusers decides once per"
        " call for the batch; omni_trio per row:\n"
    )
    rows = [
        [
            f"{item['threshold']:g}",
            f"{item['theirs_differing']} of {item['decisions']}",
            f"{item['ours_differing']} of {item['decisions']}",
        ]
        for item in result["against_diffusers"]
    ]
    parts.append(md_table(["threshold", "diffusers: differing", "omni_trio: differing"], rows))
    for item in result["wall"]:
        parts.append(
            f"\n**Time alone, {item['model']}** ({item['steps']} steps; medians of"
            f" {item['repeats']} ratios, each cached run over the uncached run beside it, of"
            " wall time and of the thread's CPU time; uncached"
            f" {item['uncached_s']:.2f} s through the runner,"
            f" {item['theirs_uncached_s']:.2f} s through the pipeline's call):\n"
        )
        rows = [
            [
                f"{row['threshold']:g}",
                str(row["ours_skipped"]),
                fmt(row["ours_block_fraction"] * 100, 0) + " %",
                f"{row['ours_wall_ratio']:.2f}x",
                f"{row['ours_cpu_ratio']:.2f}x",
                _db(row["ours_psnr_db"]),
                str(row["theirs_skipped"]),
                f"{row['theirs_wall_ratio']:.2f}x",
                f"{row['theirs_cpu_ratio']:.2f}x",
                _db(row["theirs_psnr_db"]),
                "yes" if row["same_pattern"] else "no",
            ]
            for row in item["rows"]
        ]
        parts.append(
            md_table(
                [
                    "threshold",
                    "ours: skipped",
                    "block work",
                    "wall",
                    "CPU",
                    "PSNR dB",
                    "diffusers: skipped",
                    "wall",
                    "CPU",
                    "PSNR dB",
                    "same skips",
                ],
                rows,
            )
        )
    rows = [
        [
            item["model"],
            str(item["steps"]),
            fmt(item["cpu_none_step_ms"]["median"], 2),
            fmt(item["cpu_added_us"], 0),
            f"{item['cpu_cost_pct']:+.2f} %",
            f"{item['wall_cost_pct']:+.2f} %",
        ]
        for item in result["bookkeeping"]
    ]
    parts.append(
        "\n**Bookkeeping when nothing skips** (threshold 0 vs no policy: every residual,"
        " ratio and tail kept, one host sync per call; one step of each in turn, the order"
        " alternating; the median of the pairs' differences, of the thread's CPU time and of"
        " wall time):\n"
    )
    parts.append(
        md_table(
            ["model", "pairs", "step CPU ms", "added CPU µs", "cost (CPU)", "cost (wall)"], rows
        )
    )
    return "\n".join(parts)


def plot_cache(result: dict[str, Any], path: Path) -> None:
    """Block work per threshold (tiny families); time over uncached, ours and diffusers'."""
    with figure(path, title="cache: step caching", columns=2) as (work, wall):
        for item in result["quality"]:
            rows = [row for row in item["rows"] if row["threshold"] is not None]
            work.plot(
                [row["threshold"] for row in rows],
                [row["block_fraction"] * 100 for row in rows],
                marker="o",
                label=item["kind"],
            )
        _threshold_axis(work, [row["threshold"] for row in result["quality"][0]["rows"]])
        work.set_ylabel("block work done, %")
        work.legend(fontsize=8)
        work.grid(alpha=0.3)
        largest = result["wall"][-1]
        thresholds = [row["threshold"] for row in largest["rows"]]
        for who, label, marker, color in (
            ("ours", "omni_trio", "o", PEER_COLORS["omni_trio"]),
            ("theirs", "diffusers' hook", "s", PEER_COLORS["naive"]),
        ):
            rows = largest["rows"]
            wall.plot(
                thresholds,
                [row[f"{who}_cpu_ratio"] for row in rows],
                marker=marker,
                color=color,
                label=f"{label}, CPU time",
            )
            wall.plot(
                thresholds,
                [row[f"{who}_wall_ratio"] for row in rows],
                linestyle=":",
                color=color,
                alpha=0.6,
                label=f"{label}, wall",
            )
        wall.axhline(1.0, color="#7f7f7f", linestyle=":", linewidth=1)
        _threshold_axis(wall, thresholds)
        wall.set_ylabel(f"time / uncached ({largest['model']})")
        wall.legend(fontsize=8)
        wall.grid(alpha=0.3)


def _threshold_axis(ax: Any, thresholds: list[float | None]) -> None:
    """A log axis of thresholds, ticked at the ones measured, in plain numbers."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ax.set_xscale("log")
    ax.set_xticks([t for t in thresholds if t is not None])
    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("first-block threshold")
