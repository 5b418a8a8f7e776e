"""``fastpath``: a model's step in lower precision, compiled and quantized (L89-L93), through
the engine and through the pipeline's own call with the same settings.

Two models, each saved to a folder and loaded from it both ways: the compute-bound
Flux of ``cache`` (``bench_flux``: 1 double and 3 single blocks of width 256, 128 px:
its step is mostly matrix products) and tiny SD (128 px: its step is mostly Python).
Each mode (``MODES``: eager float32, bf16, int8 weights, int8 dynamic, compiled blocks,
int8 dynamic with compiled blocks) is loaded twice:

- **the engine**: ``load(ModelSpec(source=folder, dtype=..., quantization=...,
  compile="blocks"))``, its requests through ``open_engine``;
- **the pipeline's own call** (the peer): ``from_pretrained`` with the same
  ``torch_dtype`` and the same torchao quantizer (diffusers' ``PipelineQuantizationConfig``
  over ``TorchAoConfig``), compiled as diffusers does it, regionally
  (``compile_repeated_blocks(fullgraph=True)``: its repeated block classes).

Every mode's engine and pipeline are loaded at once and a round runs each of them one
request, engine and call in alternating order, modes one after another, ``ROUNDS``
rounds (the first call of each, where a compile happens, is timed apart). A step's time
is the interval between two steps' starts (the engine: each ``runner.step`` call, so the
engine's own work between steps counts) or ends (the call: ``callback_on_step_end``):
the median over a request's steps, of the process's CPU time (one torch thread: what
other work on a shared machine does not add; inductor compiles in worker processes,
which it leaves out, so a compile is timed by the wall clock) and of wall time.
Figures: each mode's step against eager float32's (medians over the rounds), the engine
over the call per round (neighbours in time), the denoiser's weight bytes as stored,
and the PSNR of each output against eager float32's (same request and seed).

Compiled, the server's way (a full run; ``compiled``): the int8-dynamic compiled model's
**start** in a fresh process with a compile cache folder, cold (an empty folder) then
warm (the same folder); and a **churn** after the warm-up and the seal: dynamo's
recompiles, graphs and graph breaks, and the first step of a size nobody declared
against the same on an eager runner (the stall a batch beside it sees).

On a GPU (``--device cuda``: ``scripts/gpu_check.sh``) the model is FLUX.1-dev's
transformer at full size with random bf16 weights (``full_flux``), 1024 px, the modes
``GPU_MODES`` one at a time (both copies of a full model are what the memory holds).
"""

from __future__ import annotations

import gc
import importlib
import itertools
import math
import os
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import omni_trio as ot
from omni_trio.runners import load
from omni_trio.runners._quantize import torchao_quantization, weight_bytes
from omni_trio.runners._quiet import quiet_notices
from omni_trio.runners._spec import resolve_dtype

from .cache import psnr
from .common import Options, fmt, md_table
from .compiled import (
    FULL_FLUX,
    GPU_MODES,
    MODELS,
    MODES,
    QUICK_MODES,
    UNDECLARED,
    Mode,
    Model,
    build,
    churn,
    dynamo_counts,
    request_of,
    since,
    spec_of,
    stamp,
    start,
)
from .peers import call_kwargs
from .plot import PEER_COLORS, figure

__all__ = ["plot_fastpath", "run_fastpath", "table_fastpath"]


STEPS = 8
ROUNDS = 7


def _peer(folder: Path, model: Model, mode: Mode, device: str) -> Any:
    """The pipeline as its own user loads it: ``torch_dtype``, torchao through diffusers'
    quantizer on the denoiser, diffusers' regional compile."""
    diffusers: Any = importlib.import_module("diffusers")
    options: dict[str, Any] = {}
    if mode.quantization is not None:
        quantization = torchao_quantization()
        config = {
            "int8-weight": quantization.Int8WeightOnlyConfig,
            "int8-dynamic": quantization.Int8DynamicActivationInt8WeightConfig,
            "fp8": lambda: quantization.Float8DynamicActivationFloat8WeightConfig(
                granularity=quantization.PerRow()
            ),
        }[mode.quantization]()
        mapping = {model.denoiser: diffusers.TorchAoConfig(config)}
        options["quantization_config"] = diffusers.PipelineQuantizationConfig(quant_mapping=mapping)
    # diffusers 0.40 renamed ``torch_dtype`` ``dtype`` (the old name warns).
    modern = hasattr(diffusers.pipelines.pipeline_utils, "_resolve_dtype")
    options["dtype" if modern else "torch_dtype"] = resolve_dtype(mode.dtype, device)
    with quiet_notices():
        pipe = diffusers.DiffusionPipeline.from_pretrained(folder, **options)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    if mode.compiled:
        getattr(pipe, model.denoiser).compile_repeated_blocks(fullgraph=True)
    return pipe


def _stamping(runner: Any, device: str) -> list[tuple[float, float]]:
    """Stamp (wall, process CPU) at the start of each of ``runner``'s steps, into the list."""
    stamps: list[tuple[float, float]] = []
    step = runner.step

    def stamped(states: Any) -> None:
        stamps.append(stamp(device))
        step(states)

    runner.step = stamped
    return stamps


def _per_step(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    """The median interval between consecutive stamps, of wall time and of CPU time."""
    pairs = list(itertools.pairwise(stamps))
    return (
        statistics.median(b[0] - a[0] for a, b in pairs),
        statistics.median(b[1] - a[1] for a, b in pairs),
    )


def _figures(
    stamps: list[tuple[float, float]], begun: tuple[float, float], ended: tuple[float, float]
) -> dict[str, float]:
    wall, cpu = _per_step(stamps)
    return {
        "step_ms": wall * 1e3,
        "step_cpu_ms": cpu * 1e3,
        "request_s": ended[0] - begun[0],
        "request_cpu_s": ended[1] - begun[1],
    }


async def _by_engine(engine: Any, entry: dict[str, Any], request: ot.GenerationRequest) -> Any:
    stamps: list[tuple[float, float]] = entry["stamps"]
    stamps.clear()
    begun = stamp(entry["device"])
    output = await engine.generate(request)
    ended = stamp(entry["device"])
    return _figures(stamps, begun, ended), output.images.float().cpu()


def _by_call(entry: dict[str, Any], request: ot.GenerationRequest) -> Any:
    device = entry["device"]
    stamps: list[tuple[float, float]] = []

    def ended_step(pipe: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> Any:
        stamps.append(stamp(device))
        return tensors

    begun = stamp(device)
    with torch.no_grad():
        images = entry["pipe"](**call_kwargs(request), callback_on_step_end=ended_step).images
    ended = stamp(device)
    return _figures(stamps, begun, ended), images.float().cpu()


async def _measure(
    entries: list[dict[str, Any]], request: ot.GenerationRequest, rounds: int
) -> None:
    """Each entry's first calls (timed apart), then ``rounds`` interleaved rounds."""
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(ot.open_engine(entry["runner"])) for entry in entries
        ]
        for entry, engine in zip(entries, engines, strict=True):
            for who in ("engine", "call"):
                before, started = dynamo_counts(), time.perf_counter()
                if who == "engine":
                    await _by_engine(engine, entry, request)
                else:
                    _by_call(entry, request)
                entry["first_s"][who] = time.perf_counter() - started
                entry["first_counts"][who] = since(before)
        for index in range(rounds):
            for place, (entry, engine) in enumerate(zip(entries, engines, strict=True)):
                order = ("engine", "call") if (index + place) % 2 == 0 else ("call", "engine")
                for who in order:
                    if who == "engine":
                        figures, images = await _by_engine(engine, entry, request)
                    else:
                        figures, images = _by_call(entry, request)
                    entry["runs"][who].append(figures)
                    entry["images"][who] = images


def _entry(folder: Path, model: Model, mode: Mode, device: str, cache: Path) -> dict[str, Any]:
    with quiet_notices():
        runner = load(spec_of(folder, mode, cache), device=None if device == "cpu" else device)
    pipe = _peer(folder, model, mode, device)
    engine_bytes = weight_bytes(getattr(runner._pipeline, model.denoiser))
    return {
        "mode": mode,
        "device": device,
        "runner": runner,
        "pipe": pipe,
        "stamps": _stamping(runner, device),
        "first_s": {},
        "first_counts": {},
        "runs": {"engine": [], "call": []},
        "images": {},
        "weight_bytes": engine_bytes,
        "call_weight_bytes": weight_bytes(getattr(pipe, model.denoiser)),
    }


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def _mode_result(entry: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    runs, base = entry["runs"], reference["runs"]
    result: dict[str, Any] = {"mode": asdict(entry["mode"])}
    for who in ("engine", "call"):
        result[who] = {
            key: _median(runs[who], key)
            for key in ("step_ms", "step_cpu_ms", "request_s", "request_cpu_s")
        }
        result[who]["step_ratio"] = _median(runs[who], "step_cpu_ms") / _median(
            base[who], "step_cpu_ms"
        )
        result[who]["step_wall_ratio"] = _median(runs[who], "step_ms") / _median(
            base[who], "step_ms"
        )
        result[who]["first_s"] = entry["first_s"][who]
        result[who]["first_counts"] = entry["first_counts"][who]
        result[who]["psnr_db"] = _finite(psnr(entry["images"][who], reference["images"][who]))
    pairs = list(zip(runs["engine"], runs["call"], strict=True))
    result["engine_over_call"] = statistics.median(
        e["step_cpu_ms"] / c["step_cpu_ms"] for e, c in pairs
    )
    result["engine_over_call_wall"] = statistics.median(
        e["step_ms"] / c["step_ms"] for e, c in pairs
    )
    result["request_engine_over_call"] = statistics.median(
        e["request_cpu_s"] / c["request_cpu_s"] for e, c in pairs
    )
    result["engine_vs_call_psnr_db"] = _finite(
        psnr(entry["images"]["engine"], entry["images"]["call"])
    )
    result["weight_bytes"] = entry["weight_bytes"]
    result["call_weight_bytes"] = entry["call_weight_bytes"]
    result["weight_ratio"] = entry["weight_bytes"] / reference["weight_bytes"]
    return result


def _finite(value: float) -> float | None:
    """A PSNR for the JSON: ``None`` where the images are the same (infinite)."""
    return None if math.isinf(value) else value


def _model_run(
    options: Options, model: Model, modes: tuple[Mode, ...], tmp: Path
) -> dict[str, Any]:
    quick, device = options.quick, options.device
    gpu = device != "cpu"
    steps, rounds = (3, 2) if quick else (4 if gpu else STEPS, 3 if gpu else ROUNDS)
    folder, cache = tmp / model.name, tmp / f"{model.name}-compile-cache"
    with quiet_notices():
        build(model, device).save_pretrained(folder)
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()  # the full model built on it, saved, gone
    headline = modes[-1]
    starts = {}
    if not quick and not gpu and headline.compiled:
        starts = {when: start(folder, model, headline, cache) for when in ("cold", "warm")}
    groups = [[mode] for mode in modes] if gpu else [list(modes)]
    done: list[dict[str, Any]] = []
    request = request_of(model, steps)
    for group in groups:
        entries = [_entry(folder, model, mode, device, cache) for mode in group]
        options.run(_measure, entries, request, rounds)
        for entry in entries:
            entry.pop("pipe")
            entry.pop("runner")  # its engine closed it
        done.extend(entries)
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    churned = None if quick else churn(folder, model, headline, cache, device)
    return {
        "model": model.name,
        "label": model.label,
        "size": model.size,
        "steps": steps,
        "rounds": rounds,
        "modes": [_mode_result(entry, done[0]) for entry in done],
        "starts": starts,
        "churn": churned,
    }


def run_fastpath(options: Options) -> dict[str, Any]:
    """Every model in every mode, both ways; the starts and the churn (module doc)."""
    gpu = options.device != "cpu"
    models = (FULL_FLUX,) if gpu else MODELS
    modes = GPU_MODES if gpu else QUICK_MODES if options.quick else MODES
    # The compile caches' variables each model's run sets, as they were after.
    with mock.patch.dict(os.environ), tempfile.TemporaryDirectory(prefix="fastpath-") as tmp:
        results = [_model_run(options, model, modes, Path(tmp)) for model in models]
    return {
        "config": {
            "device": options.device,
            "modes": [asdict(mode) for mode in modes],
            "bench_flux": "1 double + 3 single blocks, 4 heads of 64 (width 256)",
            "undeclared": list(UNDECLARED),
            "weights": "random (seeded)",
        },
        "models": results,
        "summary": _summary(results, options.quick),
    }


def _summary(results: list[dict[str, Any]], partial: bool) -> dict[str, Any]:
    by_mode = {
        (item["model"], mode["mode"]["name"]): mode for item in results for mode in item["modes"]
    }
    first = results[0]["model"]  # the compute-bound Flux (or the full one)
    summary: dict[str, Any] = {
        "step_ratio_by_mode": {
            f"{m} {n}": v["engine"]["step_ratio"] for (m, n), v in by_mode.items()
        },
        "call_step_ratio_by_mode": {
            f"{m} {n}": v["call"]["step_ratio"] for (m, n), v in by_mode.items()
        },
        "engine_over_call_by_mode": {
            f"{m} {n}": v["engine_over_call"] for (m, n), v in by_mode.items()
        },
        "engine_over_call_max": max(v["engine_over_call"] for v in by_mode.values()),
        "psnr_db_by_mode": {
            f"{m} {n}": v["engine"]["psnr_db"]
            for (m, n), v in by_mode.items()
            if v["engine"]["psnr_db"] is not None
        },
    }
    for name, key in (
        ("bf16", "bf16_step_ratio"),
        ("compiled", "compiled_step_ratio"),
        ("int8-dynamic + compiled", "int8_compiled_step_ratio"),
        ("int8-dynamic", "int8_step_ratio"),
    ):
        if (first, name) in by_mode:
            summary[key] = by_mode[first, name]["engine"]["step_ratio"]
    if (first, "int8-dynamic") in by_mode:
        summary["int8_weight_ratio"] = by_mode[first, "int8-dynamic"]["weight_ratio"]
    churns = [item["churn"] for item in results if item["churn"] is not None]
    if churns:
        summary["recompiles_after_warm_up"] = sum(c["after_all"]["frames"] for c in churns)
        summary["graphs_after_warm_up"] = sum(c["after_all"]["graphs"] for c in churns)
        summary["graph_breaks_after_warm_up"] = sum(c["after_all"]["breaks"] for c in churns)
        summary["undeclared_stall_eager_steps"] = max(c["stall_eager_steps"] for c in churns)
    starts = {item["model"]: item["starts"] for item in results if item["starts"]}
    if starts:
        summary["cold_first_output_s"] = {m: s["cold"]["first_output_s"] for m, s in starts.items()}
        summary["warm_first_output_s"] = {m: s["warm"]["first_output_s"] for m, s in starts.items()}
    if partial:
        summary["skipped_in_quick"] = 1
    return summary


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _db(value: float | None) -> str:
    return "same" if value is None else fmt(value, 1)


def table_fastpath(result: dict[str, Any]) -> str:
    """Per model, every mode both ways; the starts; the churn and the undeclared sizes."""
    parts = [
        "Random-weight models saved to a folder and loaded from it: the engine through"
        " `load(ModelSpec(...))`, the pipeline's own call through `from_pretrained` with the"
        " same dtype and torchao quantizer, diffusers' regional compile"
        " (`compile_repeated_blocks`). A step: the process's CPU time between two steps"
        " (one torch thread), median of each request's steps, median over the rounds (wall"
        " beside it); ratios against eager float32 of the same path; engine / call per"
        " round. First call: the first request, where the compile happens (wall). PSNR"
        " against eager float32's image, same request and seed.\n",
    ]
    for item in result["models"]:
        parts.append(
            f"\n**{item['label']}** ({item['size']} px, {item['steps']} steps,"
            f" {item['rounds']} interleaved rounds):\n"
        )
        rows = [
            [
                m["mode"]["name"],
                f"{fmt(m['engine']['step_cpu_ms'], 1)} ({fmt(m['engine']['step_ms'], 1)})",
                _x(m["engine"]["step_ratio"]),
                f"{fmt(m['call']['step_cpu_ms'], 1)} ({fmt(m['call']['step_ms'], 1)})",
                _x(m["call"]["step_ratio"]),
                f"{m['engine_over_call']:.3f}",
                f"{m['request_engine_over_call']:.3f}",
                f"{m['engine']['first_s']:.1f} / {m['call']['first_s']:.1f}",
                f"{m['engine']['first_counts']['breaks']} / {m['call']['first_counts']['breaks']}",
                fmt(m["weight_bytes"] / 2**20, 2),
                _x(m["weight_ratio"]),
                f"{_db(m['engine']['psnr_db'])} / {_db(m['call']['psnr_db'])}",
                _db(m["engine_vs_call_psnr_db"]),
            ]
            for m in item["modes"]
        ]
        headers = [
            "mode",
            "engine step ms CPU (wall)",
            "vs fp32",
            "call step ms CPU (wall)",
            "vs fp32",
            "engine / call, step",
            "request",
            "first call s, engine / call",
            "graph breaks",
            "denoiser MiB",
            "vs fp32",
            "PSNR dB, engine / call",
            "engine vs call dB",
        ]
        parts.append(md_table(headers, rows))
    starts = [(item, item["starts"]) for item in result["models"] if item["starts"]]
    if starts:
        parts.append(
            "\n**Start** of a process (int8-dynamic, compiled blocks, a compile cache folder):"
            " load, a first output, then two rows warmed as `serve` does before it answers;"
            " cold (an empty folder), then warm (a second process, the same folder). Seconds"
            " from the load; the whole process (Python's imports too) beside:\n"
        )
        rows = [
            [
                item["label"],
                when,
                fmt(start["load_s"], 1),
                fmt(start["first_output_s"], 1),
                fmt(start["ready_s"], 1),
                fmt(start["process_s"], 1),
                str(start["counts"]["graphs"]),
            ]
            for item, both in starts
            for when, start in both.items()
        ]
        parts.append(
            md_table(
                [
                    "model",
                    "cache",
                    "load s",
                    "first output s",
                    "ready s",
                    "process s",
                    "graphs compiled",
                ],
                rows,
            )
        )
    churns = [
        item["churn"] | {"label": item["label"]} for item in result["models"] if item["churn"]
    ]
    if churns:
        parts.append(
            "\n**After the warm-up** (one and two rows, then `seal_compile()`): a batch of up"
            " to 3 whose members join, finish and are aborted at every step (a third with a"
            " step cache), then each undeclared size alone; dynamo's counts over all of it;"
            " an undeclared size's first step on the sealed runner against its first step on"
            " an eager runner of the same settings (the process's CPU time; wall beside):\n"
        )
        rows = [
            [
                c["label"],
                c["mode"],
                fmt(c["warm_up_s"], 1),
                f"{c['steps']} ({c['joined']} joined, rows {min(c['rows'])}-{max(c['rows'])})",
                str(c["after_all"]["frames"]),
                str(c["after_all"]["graphs"]),
                str(c["after_all"]["breaks"]),
                ", ".join(
                    f"{s['size']} px {fmt(s['sealed_cpu_ms'], 0)} vs {fmt(s['eager_cpu_ms'], 0)}"
                    for s in c["sizes"]
                ),
                f"{c['stall_eager_steps']:.2f} ({c['stall_wall_eager_steps']:.2f})",
            ]
            for c in churns
        ]
        headers = [
            "model",
            "mode",
            "warm-up s",
            "churn steps",
            "recompiles",
            "new graphs",
            "graph breaks",
            "undeclared: sealed vs eager first step, CPU ms",
            "stall, eager steps: CPU (wall)",
        ]
        parts.append(md_table(headers, rows))
    return "\n".join(parts)


def plot_fastpath(result: dict[str, Any], path: Path) -> None:
    """A step's CPU time over eager float32's, per mode, the engine and the call, per model."""
    items = result["models"]
    with figure(path, columns=len(items), title="fastpath: a step against eager fp32") as axes:
        for ax, item in zip(axes, items, strict=True):
            names = [m["mode"]["name"].replace(" + ", "\n+ ") for m in item["modes"]]
            places = range(len(names))
            for offset, who, label, color in (
                (-0.2, "engine", "omni_trio", PEER_COLORS["omni_trio"]),
                (0.2, "call", "pipeline call", PEER_COLORS["naive"]),
            ):
                ax.bar(
                    [p + offset for p in places],
                    [m[who]["step_ratio"] for m in item["modes"]],
                    width=0.4,
                    color=color,
                    label=label,
                )
            ax.axhline(1.0, color="#7f7f7f", linestyle=":", linewidth=1)
            ax.set_xticks(list(places), names, fontsize=7)
            ax.set_ylabel(f"step / eager fp32 ({item['label']})")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
