"""``serve``: open-loop HTTP load with impatient clients, ``omni-trio serve`` vs a naive server.

Two servers, each a subprocess on a free loopback port with one torch thread
(``OMP_NUM_THREADS=1``), serve the same tiny SD pipeline on the same path and
body: ``python -m omni_trio serve --model tiny-sd`` (Hypercorn on trio, its
defaults: batches of up to 4) and ``python -m benchmarks.naive`` (the pipeline's
own ``__call__`` behind a lock in a worker thread, under Uvicorn: see
``benchmarks/naive.py``).

First the solo latency of each (one request at a time, median of a few,
interleaved). omni_trio's sets the scale: its capacity is 1 / solo latency
requests per second, the SLO 3 x solo latency. Then ``omni-trio load``'s
generator (``omni_trio.serve._load``) runs Poisson arrivals at 0.5x, 1x and 2x that
capacity against each server, the same seed for both, interleaved per load; 30 %
of the clients give up at a moment uniform in [0, 2 x SLO] after sending, by
closing their connection. Between runs each server is let go idle.

Figures per server and load: SLO goodput (images within the SLO per second of the
arrival window), p50 and p99 latency of the completed requests, counts by outcome,
and the denoise steps each server ran for requests whose client had gone. The
naive server counts those itself (``/stats``). For omni_trio they come from
``/metrics``: ``omni_trio_steps_after_abort_total`` when the server exports it;
without it, the number of aborts that waited for a step in progress (abort latency
over 1 ms, in ``omni_trio_abort_latency_seconds``), each of which ran that one step
after its abort: an estimate, and the result says which (``steps_after_source``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from omni_trio.serve._load import LoadConfig, run_load

from .common import Options, fmt, md_table
from .plot import PEER_COLORS, figure

__all__ = ["plot_serve", "run_serve", "table_serve"]

SERVERS = ("naive", "omni_trio")
LOADS = (0.5, 1.0, 2.0)
#: The SLO, in omni_trio's solo latencies.
SLO_SOLO = 3.0
GIVE_UP_FRACTION = 0.3
#: Impatient clients give up within [0, GIVE_UP_SLO x SLO] after sending.
GIVE_UP_SLO = 2.0
SEED = 0
SIZE = "64x64"
#: The repository root, where ``python -m benchmarks.naive`` and ``-m omni_trio`` run.
ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 120.0
#: An abort that took longer than this waited for a step in progress.
RUNNING_ABORT_S = 0.001
STEPS_AFTER = "omni_trio_steps_after_abort_total"


@dataclass
class _Server:
    """A running server and where it answers."""

    name: str
    url: str

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _command(name: str, port: int) -> list[str]:
    if name == "naive":
        return [sys.executable, "-m", "benchmarks.naive", "--port", str(port)]
    return [
        *(sys.executable, "-m", "omni_trio", "serve", "--model", "tiny-sd"),
        *("--port", str(port), "--no-access-log", "--log-level", "warning"),
    ]


@contextmanager
def _subprocesses(log_dir: Path) -> Iterator[dict[str, _Server]]:
    """Start both servers as subprocesses at once; yield them once both answer; stop them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with ExitStack() as stack:
        servers = {}
        processes = {}
        for name in SERVERS:
            port = _free_port()
            log = log_dir / f"{name}.log"
            out = stack.enter_context(log.open("wb"))
            process = subprocess.Popen(
                _command(name, port), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env
            )
            stack.callback(_stop, process)
            servers[name] = _Server(name, f"http://127.0.0.1:{port}")
            processes[name] = process

        def failed(name: str) -> str | None:
            if processes[name].poll() is None:
                return None
            return (log_dir / f"{name}.log").read_text(errors="replace")[-2000:]

        _wait_healthy(servers, failed)
        yield servers


@contextmanager
def _threads() -> Iterator[dict[str, _Server]]:
    """``--quick``: both apps in this process, each under Uvicorn in a thread of its own.

    Seconds instead of the subprocesses' imports (tens of seconds on a busy machine);
    the servers then share the GIL with the load generator, which --quick's
    figures are not worth quoting for anyway. omni_trio's app is built as ``serve``
    builds it (its options' defaults, ``load_model``).
    """
    import argparse
    import threading

    import uvicorn

    from omni_trio.serve._cli import _service, add_serve_arguments
    from omni_trio.serve._models import load_model

    from .naive import build

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "tiny-sd"])
    apps = {
        "naive": build("sd").app,
        "omni_trio": _service(args, load_model("tiny-sd", step_seconds=0)).app,
    }
    servers: dict[str, _Server] = {}
    running: list[tuple[uvicorn.Server, threading.Thread]] = []
    try:
        for name in SERVERS:
            port = _free_port()
            config = uvicorn.Config(
                apps[name], host="127.0.0.1", port=port, log_level="warning", access_log=False
            )
            server = uvicorn.Server(config)
            thread = threading.Thread(target=server.run, name=f"serve-{name}", daemon=True)
            thread.start()
            running.append((server, thread))
            servers[name] = _Server(name, f"http://127.0.0.1:{port}")
        alive = {name: thread for name, (_, thread) in zip(SERVERS, running, strict=True)}
        _wait_healthy(servers, lambda name: None if alive[name].is_alive() else "(thread ended)")
        yield servers
    finally:
        for server, _ in running:
            server.should_exit = True
        for _, thread in running:
            thread.join(timeout=30)


def _wait_healthy(servers: dict[str, _Server], failed: Callable[[str], str | None]) -> None:
    """Return once every server's /health is 200; raise if one ended or after STARTUP_S."""
    deadline = time.monotonic() + STARTUP_S
    for name, server in servers.items():
        while not _healthy(server):
            why = failed(name)
            if why is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {why or 'timed out'}")
            time.sleep(0.05)


def _healthy(server: _Server) -> bool:
    try:
        return server.get("/health").status_code == 200
    except httpx.TransportError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _body(steps: int, seed: int) -> dict[str, Any]:
    return {
        "prompt": "a lighthouse at dusk",
        "size": SIZE,
        "num_inference_steps": steps,
        "seed": seed,
    }


def _solo_s(client: httpx.Client, server: _Server, steps: int) -> float:
    started = time.perf_counter()
    response = client.post(server.url + "/v1/images/generations", json=_body(steps, 0))
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed


def _solo(servers: dict[str, _Server], steps: int, repeats: int) -> dict[str, list[float]]:
    """Each server's latency alone, ``repeats`` times, interleaved, after two warm-ups.

    One client, no keep-alive: a new connection per request, as the load generator's.
    """
    limits = httpx.Limits(max_keepalive_connections=0)
    solo: dict[str, list[float]] = {name: [] for name in servers}
    with httpx.Client(timeout=60, limits=limits) as client:
        for server in servers.values():
            _solo_s(client, server, steps)
            _solo_s(client, server, steps)
        for _ in range(repeats):
            for name, server in servers.items():
                solo[name].append(_solo_s(client, server, steps))
    return solo


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _counters(server: _Server) -> dict[str, float]:
    """What the steps-after figure and the idle check read, now."""
    if server.name == "naive":
        stats = server.get("/stats").json()
        return {
            "busy": stats["in_flight"],
            "steps_after": stats["steps_after_disconnect"],
            "disconnected": stats["disconnected"],
            "steps_run": stats["steps_run"],
        }
    samples = _samples(server.get("/metrics").text)
    counters = {
        "busy": samples[("omni_trio_requests_running", ())]
        + samples[("omni_trio_requests_waiting", ())],
        "disconnected": samples[("omni_trio_requests_total", (("outcome", "disconnected"),))],
        "steps_run": samples[("omni_trio_engine_steps_total", ())],
    }
    if (STEPS_AFTER, ()) in samples:
        counters["steps_after"] = samples[(STEPS_AFTER, ())]
    else:
        # Aborts slower than RUNNING_ABORT_S waited for the step in progress: one each.
        quick = samples[("omni_trio_abort_latency_seconds_bucket", (("le", str(RUNNING_ABORT_S)),))]
        total = samples[("omni_trio_abort_latency_seconds_count", ())]
        counters["steps_after_estimate"] = total - quick
    return counters


def _wait_idle(server: _Server, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while _counters(server)["busy"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} still busy after {timeout:g} s")
        time.sleep(0.05)


def _log(line: str) -> None:
    print(f"serve: {line}", file=sys.stderr)


def _label(load: float) -> str:
    return f"{load:g}x"


def _measure(options: Options, server: _Server, config: LoadConfig) -> dict[str, Any]:
    """One load run against ``server``; its summary and the server-side counts."""
    _wait_idle(server)
    before = _counters(server)
    result = options.run(run_load, config)
    _wait_idle(server)
    after = _counters(server)
    delta = {key: after[key] - before[key] for key in after if key != "busy"}
    summary = result.summary()
    if "steps_after" in delta:
        steps_after, source = delta["steps_after"], "counter"
    else:
        steps_after, source = delta["steps_after_estimate"], "estimate"
    return {
        **summary,
        "elapsed_s": result.elapsed_s,
        "server_disconnected": delta["disconnected"],
        "server_steps_run": delta["steps_run"],
        "steps_after_give_up": steps_after,
        "steps_after_source": source,
    }


def run_serve(options: Options) -> dict[str, Any]:
    """Solo latencies, then every load against both servers, interleaved."""
    steps, duration_s, solo_repeats = (2, 0.5, 2) if options.quick else (20, 20.0, 7)
    started = time.perf_counter()
    with ExitStack() as stack:
        if options.quick:
            servers = stack.enter_context(_threads())
        else:
            servers = stack.enter_context(
                _subprocesses(Path(stack.enter_context(tempfile.TemporaryDirectory())))
            )
        _log(f"both servers answer /health after {time.perf_counter() - started:.1f} s")
        solo = _solo(servers, steps, solo_repeats)
        solo_s = {name: statistics.median(values) for name, values in solo.items()}
        capacity = 1 / solo_s["omni_trio"]
        slo_s = SLO_SOLO * solo_s["omni_trio"]
        _log(f"servers up and solo latencies in {time.perf_counter() - started:.1f} s")
        runs: dict[str, dict[str, Any]] = {}
        for load in LOADS:
            for name, server in servers.items():
                config = LoadConfig(
                    url=server.url + "/v1/images/generations",
                    rate=load * capacity,
                    duration_s=duration_s,
                    slo_s=slo_s,
                    seed=SEED,
                    give_up_fraction=GIVE_UP_FRACTION,
                    give_up_s=(0.0, GIVE_UP_SLO * slo_s),
                    size=SIZE,
                    steps=steps,
                )
                runs[f"{name}_{_label(load)}"] = _measure(options, server, config)
                _log(f"{name} at {_label(load)}: {time.perf_counter() - started:.1f} s")
    return {
        "config": {
            "model": "tiny-sd",
            "size": SIZE,
            "steps": steps,
            "duration_s": duration_s,
            "solo_repeats": solo_repeats,
            "loads": list(LOADS),
            "seed": SEED,
            "give_up_fraction": GIVE_UP_FRACTION,
            "give_up_span_s": [0.0, GIVE_UP_SLO * slo_s],
            "slo_over_solo": SLO_SOLO,
            "omni_trio_server": (
                "uvicorn in a thread of this process" if options.quick else "hypercorn (trio)"
            )
            + ", max_batch_size 4",
            "naive_server": (
                "uvicorn in a thread of this process" if options.quick else "uvicorn (asyncio)"
            )
            + ", the pipeline's call behind a lock in a worker thread",
            "load_backend": options.backend,
        },
        "solo_s": {name: {"median": solo_s[name], "values": solo[name]} for name in SERVERS},
        "capacity_rps": capacity,
        "slo_s": slo_s,
        "runs": runs,
        "summary": _summary(runs, solo_s, capacity, slo_s, duration_s),
    }


def _summary(
    runs: dict[str, dict[str, Any]],
    solo_s: dict[str, float],
    capacity: float,
    slo_s: float,
    duration_s: float,
) -> dict[str, Any]:
    ratios = {}
    for load in LOADS:
        label = _label(load)
        naive = runs[f"naive_{label}"]["goodput_per_s"]
        # Floored at one image per run, so that a naive server with none stays finite.
        ratios[label] = runs[f"omni_trio_{label}"]["goodput_per_s"] / max(naive, 1 / duration_s)

    def each(key: str) -> dict[str, float]:
        return {name: run[key] for name, run in runs.items() if run[key] is not None}

    return {
        "goodput_ratio_over_naive": ratios["1x"],
        "goodput_ratio_over_naive_by_load": ratios,
        "goodput_per_s": each("goodput_per_s"),
        "p50_latency_s": each("p50_latency_s"),
        "p99_latency_s": each("p99_latency_s"),
        "steps_after_give_up": each("steps_after_give_up"),
        "solo_latency_s": dict(solo_s),
        "capacity_rps": capacity,
        "slo_s": slo_s,
    }


_LABELS = {"naive": "naive", "omni_trio": "omni_trio"}


def table_serve(result: dict[str, Any]) -> str:
    """load | server | sent | completed | gave up | refused | goodput | p50 | p99 | steps."""
    config = result["config"]
    rows = []
    for load in config["loads"]:
        for name in SERVERS:
            run = result["runs"][f"{name}_{_label(load)}"]
            counts = run["counts"]
            p50, p99 = run["p50_latency_s"], run["p99_latency_s"]
            steps = fmt(run["steps_after_give_up"], 0)
            if run["steps_after_source"] == "estimate":
                steps += " (est.)"
            rows.append(
                [
                    f"{_label(load)} ({load * result['capacity_rps']:.2f}/s)",
                    _LABELS[name],
                    str(run["requests"]),
                    str(counts["completed"]),
                    str(counts["gave_up"]),
                    str(counts["refused"] + counts["error"]),
                    fmt(run["goodput_per_s"], 2),
                    fmt(run["throughput_per_s"], 2),
                    fmt(None if p50 is None else p50 * 1e3, 0),
                    fmt(None if p99 is None else p99 * 1e3, 0),
                    steps,
                ]
            )
    solo = result["solo_s"]
    ratios = result["summary"]["goodput_ratio_over_naive_by_load"]
    head = (
        f"Tiny SD, {config['size']}, {config['steps']} steps; solo latency omni_trio"
        f" {solo['omni_trio']['median'] * 1e3:.0f} ms, naive {solo['naive']['median'] * 1e3:.0f}"
        f" ms (medians of {config['solo_repeats']}); capacity 1 / omni_trio's solo latency ="
        f" {result['capacity_rps']:.2f} requests/s; SLO {result['slo_s'] * 1e3:.0f} ms"
        f" ({config['slo_over_solo']:g}x solo). Poisson arrivals for {config['duration_s']:g} s"
        f" (seed {config['seed']}); {config['give_up_fraction']:.0%} of the clients give up"
        f" within 0-{config['give_up_span_s'][1] * 1e3:.0f} ms of sending. Goodput and"
        " throughput in images/s of the arrival window; latencies (ms) of completed requests;"
        " steps: denoise steps run for requests after their client had gone. Goodput"
        " omni_trio / naive: "
        + ", ".join(f"{label} {ratio:.2f}x" for label, ratio in ratios.items())
        + ".\n\n"
    )
    return head + md_table(
        [
            "load",
            "server",
            "sent",
            "completed",
            "gave up",
            "refused/error",
            "goodput",
            "throughput",
            "p50",
            "p99",
            "steps after give-up",
        ],
        rows,
    )


def plot_serve(result: dict[str, Any], path: Path) -> None:
    """Goodput and p99 latency per load, one bar per server."""
    loads = result["config"]["loads"]
    x = range(len(loads))
    with figure(path, columns=2, title="serve: open-loop load, 30% impatient clients") as (a, b):
        for offset, name in zip((-0.2, 0.2), SERVERS, strict=True):
            runs = [result["runs"][f"{name}_{_label(load)}"] for load in loads]
            color = PEER_COLORS[name]
            a.bar([i + offset for i in x], [r["goodput_per_s"] for r in runs], 0.4, color=color)
            p99 = [(r["p99_latency_s"] or 0.0) * 1e3 for r in runs]
            b.bar([i + offset for i in x], p99, 0.4, color=color, label=_LABELS[name])
        slo_ms = result["slo_s"] * 1e3
        b.axhline(slo_ms, color="#333333", linestyle="--", linewidth=1, label="SLO")
        for ax, ylabel in ((a, "SLO goodput, images/s"), (b, "p99 latency, ms")):
            ax.set_xticks(list(x), [_label(load) + " capacity" for load in loads])
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
        b.legend(fontsize=8)
