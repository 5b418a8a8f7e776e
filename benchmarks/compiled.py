"""The models and modes of ``fastpath``, and a compiled model run the way a server runs it.

- **start**: a fresh process (``python -m benchmarks.compiled ORDER CACHE``) loads a
  compiled model with a compile cache folder (``ModelSpec.compile_cache``), makes a first
  output, then steps two rows together (what ``serve`` warms before it answers): the
  seconds from the load to the first output and to ready, and dynamo's counts. Cold with
  an empty folder, warm with the one a first process filled.
- **dry run** (``python -m benchmarks.compiled --dry``): ``full_flux``'s wiring checked on a
  CPU, for the device check (``scripts/gpu_check.sh``) that runs it at full size.
- **churn**: a new runner of that model warmed at one and two rows, then sealed
  (``seal_compile``); a batch of up to three whose members join, finish and are aborted
  at random steps (some with a step cache, where the family has one), then requests of
  sizes nobody declared (``UNDECLARED``). Dynamo's counters (frames compiled, graphs made,
  graph breaks) before and after; each undeclared size's first step against its first
  step on an eager runner of the same settings: the stall a batch beside it would see.
"""

from __future__ import annotations

import importlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

import omni_trio as ot
from omni_trio.runners import ModelSpec, load, tiny_pipeline
from omni_trio.runners._quiet import quiet_notices

from .cache import bench_flux

__all__ = [
    "FULL_FLUX",
    "GPU_MODES",
    "MODELS",
    "MODES",
    "QUICK_MODES",
    "Mode",
    "Model",
    "build",
    "churn",
    "dynamo_counts",
    "full_flux",
    "request_of",
    "spec_of",
    "stamp",
    "start",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Mode:
    """How a model's step runs: its dtype, its quantization, compiled blocks or not."""

    name: str
    dtype: str = "fp32"
    quantization: str | None = None
    compiled: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    """A model of the benchmark: its size in pixels, its guidance, its denoiser's name."""

    name: str
    label: str
    size: int
    guidance: float
    denoiser: str


MODES = (
    Mode(name="fp32"),
    Mode(name="bf16", dtype="bf16"),
    Mode(name="int8-weight", quantization="int8-weight"),
    Mode(name="int8-dynamic", quantization="int8-dynamic"),
    Mode(name="compiled", compiled=True),
    Mode(name="int8-dynamic + compiled", quantization="int8-dynamic", compiled=True),
)
#: ``--quick`` compiles nothing: a cold compile takes 10-90 s on this CPU.
QUICK_MODES = (MODES[0], MODES[1], MODES[3])
#: On a GPU, each loaded twice at full size (a load of 24 GB takes seconds): three fit
#: the device check's ten minutes with the churn (fp8 eager is its stall's reference).
GPU_MODES = (
    Mode(name="bf16", dtype="bf16"),
    Mode(name="bf16 + compiled", dtype="bf16", compiled=True),
    Mode(name="fp8 + compiled", dtype="bf16", quantization="fp8", compiled=True),
)
MODELS = (
    Model(name="flux", label="compute-bound Flux", size=128, guidance=3.5, denoiser="transformer"),
    Model(name="sd", label="tiny SD", size=128, guidance=5.0, denoiser="unet"),
)
FULL_FLUX = Model(
    name="flux-full", label="full-size Flux", size=1024, guidance=3.5, denoiser="transformer"
)
#: The steps of a start's first output.
FIRST_STEPS = 8
#: The churn's steps after the seal, and the sizes nobody declared (the declared: the
#: model's size).
CHURN_STEPS = 24
UNDECLARED = (80, 96, 112)
#: The most a start process may take (a cold compile on a loaded 2-core machine).
START_LIMIT_S = 900
ROOT = Path(__file__).resolve().parent.parent


def request_of(model: Model, steps: int, seed: int = 1, **fields: Any) -> ot.GenerationRequest:
    """The benchmark's request on ``model`` (its size unless ``fields`` say otherwise)."""
    values: dict[str, Any] = {"height": model.size, "width": model.size, **fields}
    return ot.GenerationRequest(
        prompt=f"a lighthouse on a cliff at dusk {seed}",
        num_steps=steps,
        guidance_scale=model.guidance,
        seed=seed,
        **values,
    )


def spec_of(folder: Path, mode: Mode, cache: Path | None = None) -> ModelSpec:
    """The ``ModelSpec`` of ``mode`` over the saved pipeline in ``folder``."""
    return ModelSpec(
        source=str(folder),
        dtype=mode.dtype,
        quantization=mode.quantization,
        compile="blocks" if mode.compiled else None,
        compile_cache=str(cache) if mode.compiled and cache is not None else None,
    )


def full_flux(device: str, *, blocks: tuple[int, int] = (19, 38)) -> Any:
    """FLUX.1-dev's transformer (width 3072, ``blocks`` double and single blocks) with seeded
    random bf16 weights on ``device``, behind tiny Flux's tokenizers, VAE and scheduler
    and tiny text encoders of its widths (T5 4096, CLIP 768; float32, on the CPU): at
    1024 px a step is 4096 image and 512 text tokens, as the real model's."""
    diffusers: Any = importlib.import_module("diffusers")  # untyped constructors
    transformers: Any = importlib.import_module("transformers")
    base = tiny_pipeline("flux")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: 24 GB, not 48 GB first
    try:
        with torch.device(device):
            transformer = diffusers.FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,
                num_layers=blocks[0],
                num_single_layers=blocks[1],
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            ).eval()
    finally:
        torch.set_default_dtype(previous)
    t5, clip = base.text_encoder_2.config, base.text_encoder.config
    t5.d_model, clip.hidden_size = 4096, 768
    encoders = {
        "text_encoder": transformers.CLIPTextModel(clip).eval(),
        "text_encoder_2": transformers.T5EncoderModel(t5).eval(),
    }
    # The rest stays float32 (a few MB): a load in bf16 casts it.
    return diffusers.FluxPipeline(**{**base.components, **encoders, "transformer": transformer})


def build(model: Model, device: str) -> Any:
    """``model``'s pipeline, in memory (float32, but the full-size Flux's bf16)."""
    if model.name == "flux":
        return bench_flux()
    if model.name == "sd":
        return tiny_pipeline("sd")
    return full_flux(device)


def stamp(device: str) -> tuple[float, float]:
    """Now, as (wall, the process's CPU time), once ``device``'s queued work is done."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def dynamo_counts() -> dict[str, int]:
    """Dynamo's process-wide counts: frames compiled, graphs made, graph breaks."""
    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": sum(counters["graph_break"].values()),
    }


def since(before: dict[str, int]) -> dict[str, int]:
    """Dynamo's counts since ``before``."""
    now = dynamo_counts()
    return {key: now[key] - before[key] for key in now}


def _stepped(runner: Any, requests: list[ot.GenerationRequest], steps: int) -> None:
    states = [runner.prepare(r, f"warm-{index}") for index, r in enumerate(requests)]
    for _ in range(steps):
        runner.step(states)
    for state in states:
        runner.discard(state)


def _first_step(runner: Any, request: ot.GenerationRequest, device: str) -> tuple[float, float]:
    """``request``'s first step alone: its (wall, CPU) seconds."""
    state = runner.prepare(request, f"size-{request.height}")
    begun = stamp(device)
    runner.step([state])
    ended = stamp(device)
    runner.discard(state)
    return ended[0] - begun[0], ended[1] - begun[1]


def _churning(runner: Any, model: Model, steps: int) -> dict[str, Any]:
    """A batch of up to 3 that members join, finish and leave (aborted) at random steps."""
    cached = "first-block" in runner.capabilities.step_cache
    rng = random.Random(0)
    members: list[tuple[Any, int]] = []  # (state, steps left)
    rows: list[int] = []
    joined = 0
    for _ in range(steps):
        for member in list(members):
            if member[1] == 0 or rng.random() < 0.2:  # finished, or aborted
                runner.discard(member[0])
                members.remove(member)
        while len(members) < 3 and (not members or rng.random() < 0.6):
            joined += 1
            policy = ot.StepCache(kind="first-block", threshold=0.4)
            r = request_of(
                model,
                rng.randint(2, 6),
                seed=100 + joined,
                cache=policy if cached and rng.random() < 0.3 else None,
            )
            members.append((runner.prepare(r, f"churn-{joined}"), r.denoise_steps))
        runner.step([state for state, _ in members])
        rows.append(len(members))
        members = [(state, left - 1) for state, left in members]
    for state, _ in members:
        runner.discard(state)
    return {"steps": steps, "rows": rows, "joined": joined, "step_caches": cached}


def churn(folder: Path, model: Model, mode: Mode, cache: Path, device: str) -> dict[str, Any]:
    """Warm-up at one and two rows, seal, churn, then the undeclared sizes (module doc)."""
    where = None if device == "cpu" else device
    runner = load(spec_of(folder, mode, cache), device=where, max_batch_size=3)
    eager = load(spec_of(folder, replace(mode, compiled=False)), device=where, max_batch_size=3)
    try:
        started = time.perf_counter()
        _stepped(runner, [request_of(model, 2, seed=90)], 1)
        _stepped(runner, [request_of(model, 2, seed=91), request_of(model, 2, seed=92)], 1)
        warm_up_s = time.perf_counter() - started
        runner.seal_compile()
        before = dynamo_counts()
        churned = _churning(runner, model, CHURN_STEPS)
        after_churn = since(before)
        sizes = []
        for index, size in enumerate(UNDECLARED):
            r = request_of(model, 3, seed=200 + index, height=size, width=size)
            pair = [(runner, "sealed"), (eager, "eager")]
            timed = {who: _first_step(run, r, device) for run, who in pair[:: 1 - 2 * (index % 2)]}
            sizes.append(
                {
                    "size": size,
                    "sealed_ms": timed["sealed"][0] * 1e3,
                    "sealed_cpu_ms": timed["sealed"][1] * 1e3,
                    "eager_ms": timed["eager"][0] * 1e3,
                    "eager_cpu_ms": timed["eager"][1] * 1e3,
                    "stall_eager_steps": timed["sealed"][1] / timed["eager"][1],
                    "stall_wall_eager_steps": timed["sealed"][0] / timed["eager"][0],
                }
            )
        after_all = since(before)
    finally:
        runner.close()
        eager.close()
    return {
        "model": model.name,
        "mode": mode.name,
        "warm_up_s": warm_up_s,
        **churned,
        "churn": after_churn,
        "after_all": after_all,
        "sizes": sizes,
        "stall_eager_steps": statistics.median(s["stall_eager_steps"] for s in sizes),
        "stall_wall_eager_steps": statistics.median(s["stall_wall_eager_steps"] for s in sizes),
    }


def start(folder: Path, model: Model, mode: Mode, cache: Path) -> dict[str, Any]:
    """A fresh process's start with ``cache`` (module doc); the whole process's seconds too."""
    order = json.dumps({"folder": str(folder), "model": model.name, "mode": asdict(mode)})
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.compiled", order, str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_LIMIT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the start process failed: {done.stderr[-2000:]}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {**figures, "process_s": time.perf_counter() - started}


def _started(order: dict[str, Any], cache: str) -> dict[str, Any]:
    """The start process's side of ``start``."""
    torch.set_num_threads(1)  # as the benchmarks' process
    model = next(m for m in MODELS if m.name == order["model"])
    mode = Mode(**order["mode"])
    started = time.perf_counter()
    with quiet_notices():
        runner = load(spec_of(Path(order["folder"]), mode, Path(cache)), max_batch_size=3)
    loaded = time.perf_counter()
    state = runner.prepare(request_of(model, FIRST_STEPS), "first")
    for _ in range(FIRST_STEPS):
        runner.step([state])
    runner.decode(state)
    runner.discard(state)
    first = time.perf_counter()
    _stepped(runner, [request_of(model, 2, seed=2), request_of(model, 2, seed=3)], 1)
    ready = time.perf_counter()
    runner.close()
    return {
        "load_s": loaded - started,
        "first_output_s": first - started,
        "ready_s": ready - started,
        "counts": dynamo_counts(),
    }


def dry_run() -> dict[str, Any]:
    """``full_flux``'s wiring on a CPU in seconds: one double and one single block of full
    width, saved, loaded in bf16 through ``load`` and stepped once at 64 px."""
    with tempfile.TemporaryDirectory(prefix="full-flux-") as folder:
        with quiet_notices():
            full_flux("cpu", blocks=(1, 1)).save_pretrained(folder)
            runner = load(ModelSpec(source=folder, dtype="bf16"))
        r = request_of(FULL_FLUX, 2, height=64, width=64)
        state = runner.prepare(r, "dry")
        for _ in range(r.denoise_steps):
            runner.step([state])
        images = runner.decode(state)
        runner.discard(state)
        runner.close()
    return {"images": list(images.shape), "finite": bool(images.float().isfinite().all())}


if __name__ == "__main__":
    if sys.argv[1:] == ["--dry"]:
        sys.stdout.write(json.dumps(dry_run()) + "\n")
    else:
        sys.stdout.write(json.dumps(_started(json.loads(sys.argv[1]), sys.argv[2])) + "\n")
