"""``adapters``: four requests with four different LoRAs in one batch vs the peers' way.

On the compute-bound Flux of the ``cache`` benchmark (``bench_flux``: 1 double and 3
single blocks of width 256, at 128 x 128 px), four random rank-8 LoRAs on the
transformer's attention (``to_q``, ``to_k``, ``to_v``, ``to_out.0``), made with peft
and loaded from ``.safetensors`` files. The arms, each four images of the same four
prompts and seeds, timed as wall time and this thread's CPU time (one torch thread:
every kernel runs in it), alternating:

- ``mixed``: one batch of 4 requests, each with its own adapter (scale 0.8), through a
  ``DiffusersRunner`` (``prepare``, ``step`` together, ``decode``);
- ``sequential``: the peers' way: the pipeline's own call four times, one after
  another, with ``set_adapters([name], [0.8])`` before each (a second copy of the
  pipeline with the same files loaded by diffusers);
- ``same``: one batch of 4 with one adapter for all (what a server that merges one
  set server-wide can batch);
- ``none``: one batch of 4 with no adapter.

The throughput ratio is sequential over mixed; the adapters' cost is mixed over none,
minus one. Load and unload times are ``DiffusersRunner.load_adapter`` of one file
and ``unload_adapter``, each timed alone.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import omni_trio as ot

from .cache import BENCH_SIZE, bench_flux
from .common import Options, fmt, md_table, spread
from .plot import bar_with_range, figure

__all__ = ["plot_adapters", "run_adapters", "table_adapters"]

RANK = 8
SCALE = 0.8
NAMES = ("ink", "film", "dust", "neon")
ARMS = ("mixed", "sequential", "same", "none")


def _make_loras(pipe: Any, folder: Path) -> dict[str, Path]:
    """Four random rank-8 LoRAs for ``pipe``'s transformer, saved as diffusers saves them."""
    from omni_trio.runners import tiny_lora

    return {
        name: tiny_lora(pipe, folder, name, seed=seed, rank=RANK, alpha=RANK, text=False)
        for seed, name in enumerate(NAMES)
    }


def _request(index: int, steps: int, adapters: dict[str, float]) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a lighthouse, take {index}",
        num_steps=steps,
        height=BENCH_SIZE,
        width=BENCH_SIZE,
        guidance_scale=3.5,
        seed=index,
        adapters=adapters,
    )


def _batch(runner: Any, requests: list[ot.GenerationRequest]) -> None:
    states = [runner.prepare(r, f"r{i}") for i, r in enumerate(requests)]
    for _ in range(requests[0].num_steps):
        runner.step(states)
    for state in states:
        runner.decode(state)
        runner.discard(state)


def _sequential(pipe: Any, requests: list[ot.GenerationRequest]) -> None:
    import torch

    for r in requests:
        ((name, scale),) = r.adapter_pairs
        pipe.set_adapters([name], [scale])
        pipe(
            r.prompt,
            num_inference_steps=r.num_steps,
            height=r.height,
            width=r.width,
            guidance_scale=r.guidance_scale,
            generator=torch.Generator().manual_seed(r.seed or 0),
            output_type="pt",
        )


def _clocked(call: Callable[[], Any], device: str) -> tuple[float, float]:
    """Wall and this thread's CPU seconds of ``call``, the device's queue drained after."""
    import torch

    wall, cpu = time.perf_counter(), time.thread_time()
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.thread_time() - cpu


def _load_times(pipe: Any, files: dict[str, Path], repeats: int) -> dict[str, dict[str, float]]:
    from omni_trio.runners import DiffusersRunner

    runner = DiffusersRunner(pipe)
    loads, unloads = [], []
    try:
        for i in range(repeats):
            path = files[NAMES[i % len(NAMES)]]
            started = time.perf_counter()
            runner.load_adapter("timed", path)
            loads.append(time.perf_counter() - started)
            started = time.perf_counter()
            runner.unload_adapter("timed")
            unloads.append(time.perf_counter() - started)
    finally:
        runner.close()
    return {"load_s": spread(loads), "unload_s": spread(unloads)}


def run_adapters(options: Options) -> dict[str, Any]:
    """Time the four arms, alternating; then loads and unloads."""
    import torch

    from omni_trio.runners import DiffusersRunner
    from omni_trio.runners._tinylora import DENOISER_TARGETS

    steps, repeats = (1, 1) if options.quick else (8, 5)
    folder = Path(tempfile.mkdtemp(prefix="omni-trio-adapters-"))
    ours, theirs = bench_flux().to(options.device), bench_flux().to(options.device)
    files = _make_loras(ours, folder)
    runner = DiffusersRunner(ours, max_batch_size=4)
    for name, path in files.items():
        runner.load_adapter(name, path)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            theirs.load_lora_weights(str(folder), weight_name=path.name, adapter_name=name)
    adapter_bytes = runner.adapters()[0].bytes
    mixed = [_request(i, steps, {name: SCALE}) for i, name in enumerate(NAMES)]
    calls: dict[str, Callable[[], Any]] = {
        "mixed": lambda: _batch(runner, mixed),
        "sequential": lambda: _sequential(theirs, mixed),
        "same": lambda: _batch(runner, [_request(i, steps, {"ink": SCALE}) for i in range(4)]),
        "none": lambda: _batch(runner, [_request(i, steps, {}) for i in range(4)]),
    }
    with torch.no_grad():
        for call in calls.values():
            call()  # warm-up
        times: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
        for repeat in range(repeats):
            order = ARMS if repeat % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                times[arm].append(_clocked(calls[arm], options.device))
    runner.close()  # its adapters leave the pipeline: the loads below start from none
    loading = _load_times(ours, files, 3 if options.quick else 10)
    wall = {arm: spread([t[0] for t in runs]) for arm, runs in times.items()}
    cpu = {arm: spread([t[1] for t in runs]) for arm, runs in times.items()}

    def ratios(top: str, bottom: str, which: int) -> list[float]:
        return [a[which] / b[which] for a, b in zip(times[top], times[bottom], strict=True)]

    return {
        "config": {
            "model": "compute-bound flux (bench_flux)",
            "device": options.device,
            "size": BENCH_SIZE,
            "steps": steps,
            "batch": 4,
            "rank": RANK,
            "scale": SCALE,
            "targets": list(DENOISER_TARGETS),
            "repeats": repeats,
            "adapter_bytes": adapter_bytes,
            "torch_threads": torch.get_num_threads(),
        },
        "wall_s": wall,
        "cpu_s": cpu,
        "loading": loading,
        "summary": {
            "throughput_ratio_over_sequential": spread(ratios("sequential", "mixed", 0))["median"],
            "throughput_ratio_over_sequential_cpu": spread(ratios("sequential", "mixed", 1))[
                "median"
            ],
            "cost_over_none_pct": (spread(ratios("mixed", "none", 0))["median"] - 1) * 100,
            "cost_over_none_cpu_pct": (spread(ratios("mixed", "none", 1))["median"] - 1) * 100,
            "mixed_over_same": spread(ratios("mixed", "same", 0))["median"],
            "load_ms": loading["load_s"]["median"] * 1e3,
            "unload_ms": loading["unload_s"]["median"] * 1e3,
        },
    }


_LABELS = {
    "mixed": "one batch of 4, four different adapters",
    "sequential": "4 pipeline calls, set_adapters between (the peers' way)",
    "same": "one batch of 4, one adapter for all",
    "none": "one batch of 4, no adapter",
}


def table_adapters(result: dict[str, Any]) -> str:
    """Each arm's time for four images, and the headline ratios."""
    config, summary = result["config"], result["summary"]
    mixed = result["wall_s"]["mixed"]["median"]
    rows = []
    for arm in ARMS:
        wall = result["wall_s"][arm]
        rows.append(
            [
                _LABELS[arm],
                fmt(wall["median"] * 1e3, 1),
                f"{fmt(wall['min'] * 1e3, 1)} - {fmt(wall['max'] * 1e3, 1)}",
                fmt(result["cpu_s"][arm]["median"] * 1e3, 1),
                fmt(4 / wall["median"], 2),
                fmt(wall["median"] / mixed, 2),
            ]
        )
    head = (
        f"Compute-bound Flux on {config.get('device', 'cpu')}, {config['size']} px,"
        f" {config['steps']} steps, 4 images per arm,"
        f" rank-{config['rank']} LoRAs on the transformer's attention"
        f" ({config['adapter_bytes']:,} bytes each), {config['repeats']} alternating repeats,"
        f" {config['torch_threads']} torch thread(s). Throughput of the mixed batch over one"
        f" after another with set_adapters: {summary['throughput_ratio_over_sequential']:.2f}x"
        f" (CPU time {summary['throughput_ratio_over_sequential_cpu']:.2f}x; target ≥ 2.5x);"
        f" the adapters' cost over no adapter: {summary['cost_over_none_pct']:+.1f} %"
        f" (CPU {summary['cost_over_none_cpu_pct']:+.1f} %; target ≤ 15 %); load"
        f" {summary['load_ms']:.1f} ms, unload {summary['unload_ms']:.1f} ms (median)."
        "\n\n"
    )
    return head + md_table(["arm", "wall ms", "range", "CPU ms", "images/s", "vs mixed"], rows)


def plot_adapters(result: dict[str, Any], path: Path) -> None:
    """Wall time of four images per arm."""
    with figure(path, title="adapters: four images, four LoRAs") as (ax,):
        bar_with_range(
            ax,
            ["mixed", "sequential\n(set_adapters)", "one adapter", "none"],
            [result["wall_s"][arm] for arm in ARMS],
            ylabel="ms for 4 images",
            scale=1e3,
        )
