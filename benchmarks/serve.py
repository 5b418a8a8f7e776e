"""``serve``: open-loop HTTP load with impatient clients, ``omni-trio serve`` vs a naive server.

Two servers, each a subprocess on a free loopback port with one torch thread
(``OMP_NUM_THREADS=1``), serve the same tiny SD pipeline on the same path and
body: ``python -m omni_trio serve --model tiny-sd --max-priority 1`` (Hypercorn on
trio, its defaults: batches of up to 4, preemption on) and ``python -m
benchmarks.naive`` (the pipeline's own ``__call__`` behind a lock in a worker
thread, under Uvicorn: see ``benchmarks/naive.py``).

Both are warmed up first (two requests each, then a burst of four, so that
omni_trio has run every batch size before anything is timed). Then the solo
latency of each (one request at a time, interleaved, median of several), for the
record. The naive server sets the scale, and it is measured again before each
seed: CALIBRATION requests one at a time give its solo latency (the SLO is 3 x
its median) and its median call time (``/stats``: time inside the pipeline's
call); its capacity is 1 / that call time requests per second (it serves one request at
a time, and under load the encoding of one answer overlaps the next call). The
load levels are fractions of that capacity, so "1x" is the load at which the
naive server starts to queue without bound. Two earlier choices made the 1x
ratio swing from 1.2x to 21x between runs: the scale came from omni_trio's solo
latency (faster than naive's, so "1x" overloaded the naive server by ~1.2x), and
it was measured once, while on a shared machine the speed drifts by 2x within
minutes. Each naive run also reports the load it really faced (its
``effective_load``: the requests sent times its mean call time in that run, per
second of the window).

Then ``omni-trio load``'s generator (``omni_trio.cli._loadtest``) runs arrivals at
0.5x, 1x and 2x that capacity, for each of ``SEEDS``: exactly rate x window
requests at the moments of a Poisson process conditioned on that count (in a
window of a dozen requests a Poisson count alone moves the load by 30 %). Every
peer of a seed gets the same schedule: same arrival times, same impatient
clients, same priority classes. 30 % of the clients give up at a moment uniform in
[0, 2 x SLO] after sending, by closing their connection. The peers:

- ``naive``, once per load and seed: it ignores ``priority`` and ``deadline_ms``,
  so the same run is the peer of every omni_trio mode. Its bodies carry the
  priority field of the ``priority`` mode (ignored), so that its goodput splits by
  the same client classes.
- ``omni_trio``: plain bodies, FIFO.
- ``omni_trio_deadline`` (1x and 2x): every body has ``deadline_ms`` = the SLO, so
  the server refuses (429 ``deadline_unmeetable``) what its estimate says will be
  late and aborts what passes its deadline.
- ``omni_trio_priority`` (1x and 2x): ``PRIORITY_SHARE`` of the clients send
  ``priority`` 1; their SLO goodput is reported apart from the others'.

At each load and seed the peers run one after the other, their order rotated by
the seed; each run starts with its server idle and ends when it is idle again.

Figures per peer and load: SLO goodput (images within the SLO per second of the
arrival window; median and range over the seeds), p50 and p99 latency of the
completed requests (pooled over the seeds), counts by outcome (summed), and the
denoise steps each server ran for requests whose client had gone. The naive
server counts those itself (``/stats``). For omni_trio they come from
``/metrics``: ``omni_trio_steps_after_abort_total`` when the server exports it;
without it, the number of aborts that waited for a step in progress (abort latency
over 1 ms, in ``omni_trio_abort_latency_seconds``), each of which ran that one step
after its abort: an estimate, and the result says which (``steps_after_source``).
The goodput ratios over naive are taken per seed (a naive goodput of 0 is
floored at one image per window) and reported as median, min and max; the
pooled ratio divides the good images summed over the seeds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from omni_trio.cli._loadtest import LoadConfig, run_load
from omni_trio.cli._loadtest_math import DEFAULT_CLASS, percentile, priority_class

from .common import Options, fmt, md_table
from .plot import PEER_COLORS, figure

__all__ = ["plot_serve", "run_serve", "table_serve"]

SERVERS = ("naive", "omni_trio")
LOADS = (0.5, 1.0, 2.0)
#: Every peer (a server and what its bodies carry), and the loads it runs at:
#: deadlines and priorities change nothing where nothing queues.
PEER_LOADS: dict[str, tuple[float, ...]] = {
    "naive": LOADS,
    "omni_trio": LOADS,
    "omni_trio_deadline": (1.0, 2.0),
    "omni_trio_priority": (1.0, 2.0),
}
PEERS = tuple(PEER_LOADS)
#: One schedule per seed, the same for every peer. Three seeds of DURATION_S keep
#: the full run near five minutes on a 2-core machine.
SEEDS = (0, 1, 2)
DURATION_S = 6.0
#: The SLO, in the naive server's solo latencies.
SLO_SOLO = 3.0
GIVE_UP_FRACTION = 0.3
#: Impatient clients give up within [0, GIVE_UP_SLO x SLO] after sending.
GIVE_UP_SLO = 2.0
#: The ``priority`` mode: this share of the clients send ``priority`` PRIORITY.
PRIORITY = 1
PRIORITY_SHARE = 0.2
#: Concurrent requests of the warm-up burst: omni_trio's max_batch_size.
WARM_UP_BURST = 4
#: Requests, one at a time, that calibrate the naive server before each seed.
CALIBRATION = 7
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
        *("--max-priority", str(PRIORITY)),
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
    builds it (its options' defaults, ``ServiceOptions``).
    """
    import argparse
    import threading

    import uvicorn

    from omni_trio.cli._options import make_service, service_options
    from omni_trio.cli._serve import add_serve_arguments

    from .naive import build

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", "tiny-sd", "--max-priority", str(PRIORITY)])
    options = service_options(args)
    apps = {
        "naive": build("sd").app,
        "omni_trio": make_service(options, options.load_model()).app,
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


def _burst(server: _Server, steps: int, size: int) -> None:
    """``size`` requests at once, each on a client of its own; wait for every answer."""

    def one() -> float:
        with httpx.Client(timeout=120) as client:
            return _solo_s(client, server, steps)

    with ThreadPoolExecutor(size) as pool:
        for sent in [pool.submit(one) for _ in range(size)]:
            sent.result()


def _solo(
    servers: dict[str, _Server], steps: int, repeats: int, *, warm_up: bool = True
) -> dict[str, list[float]]:
    """Each server's latency alone, ``repeats`` times, interleaved, after a warm-up.

    The warm-up: two requests one at a time, then WARM_UP_BURST at once (omni_trio
    batches them: its first batch of each size is slower). One client, no
    keep-alive: a new connection per request, as the load generator's.
    """
    limits = httpx.Limits(max_keepalive_connections=0)
    solo: dict[str, list[float]] = {name: [] for name in servers}
    with httpx.Client(timeout=120, limits=limits) as client:
        for server in servers.values() if warm_up else ():
            _solo_s(client, server, steps)
            _solo_s(client, server, steps)
            _burst(server, steps, WARM_UP_BURST)
        for _ in range(repeats):
            for name, server in servers.items():
                solo[name].append(_solo_s(client, server, steps))
    return solo


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scale:
    """The naive server's speed now: what a seed's rates and SLO are made of."""

    solo_s: list[float]
    call_s: float

    @property
    def capacity_rps(self) -> float:
        return 1 / self.call_s

    @property
    def slo_s(self) -> float:
        return SLO_SOLO * statistics.median(self.solo_s)

    def as_json(self) -> dict[str, Any]:
        return {
            "solo_s": self.solo_s,
            "solo_median_s": statistics.median(self.solo_s),
            "call_s": self.call_s,
            "capacity_rps": self.capacity_rps,
            "slo_s": self.slo_s,
        }


def _calibrate(naive: _Server, steps: int, repeats: int) -> _Scale:
    """``repeats`` solo requests to the naive server: its solo latencies, median call time.

    Each call's time is read from ``/stats`` around it; the median resists the one
    request that another process on the machine slowed down or left alone.
    """
    limits = httpx.Limits(max_keepalive_connections=0)
    solo, calls = [], []
    with httpx.Client(timeout=120, limits=limits) as client:
        for _ in range(repeats):
            before = naive.get("/stats").json()["busy_s"]
            solo.append(_solo_s(client, naive, steps))
            calls.append(naive.get("/stats").json()["busy_s"] - before)
    return _Scale(solo_s=solo, call_s=statistics.median(calls))


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
            "calls": stats["calls"],
            "busy_s": stats["busy_s"],
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


def _server_of(peer: str) -> str:
    return "naive" if peer == "naive" else "omni_trio"


def _peer_config(peer: str, config: LoadConfig) -> LoadConfig:
    """What ``peer``'s bodies carry on top of ``config``'s plain ones."""
    if peer == "omni_trio_deadline":
        return replace(config, deadline_ms=max(1, round(config.slo_s * 1000)))
    if peer in ("naive", "omni_trio_priority"):
        # The naive server ignores the field; its records then split by the same classes.
        return replace(config, priority=PRIORITY, priority_share=PRIORITY_SHARE)
    return config


def _measure(options: Options, server: _Server, config: LoadConfig) -> dict[str, Any]:
    """One load run against ``server``, from idle to idle: its summary and the server's counts."""
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
    extra: dict[str, float] = {}
    if delta.get("calls"):
        # The naive server's real service time in this run, and the load it really
        # faced: the work sent over the window, in its own call times.
        extra["service_s"] = delta["busy_s"] / delta["calls"]
        extra["effective_load"] = summary["requests"] * extra["service_s"] / config.duration_s
    latencies: dict[str, list[float]] = {}
    for record in result.records:
        if record.outcome == "completed":
            key = priority_class(record.priority)
            latencies.setdefault(key, []).append(round(record.latency_s, 4))
    return {
        **summary,
        "seed": config.seed,
        "elapsed_s": result.elapsed_s,
        "server_disconnected": delta["disconnected"],
        "server_steps_run": delta["steps_run"],
        "steps_after_give_up": steps_after,
        "steps_after_source": source,
        **extra,
        # Per priority class, so that the pooled percentiles can be taken over the seeds.
        "latencies_s": {key: sorted(values) for key, values in sorted(latencies.items())},
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def run_serve(options: Options) -> dict[str, Any]:
    """Warm-up and solo latencies, then every seed, load and peer, rotated."""
    seeds: tuple[int, ...]
    if options.quick:
        steps, duration_s, solo_repeats, seeds, calibration = 2, 0.5, 2, SEEDS[:1], 2
    else:
        steps, duration_s, solo_repeats, seeds, calibration = 20, DURATION_S, 7, SEEDS, CALIBRATION
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
        _log(f"warm-up and solo latencies done at {time.perf_counter() - started:.1f} s")
        runs: dict[str, list[dict[str, Any]]] = {}
        scales: dict[int, _Scale] = {}
        for seed in seeds:
            scale = scales[seed] = _calibrate(servers["naive"], steps, calibration)
            capacity, slo_s = scale.capacity_rps, scale.slo_s
            _log(f"seed {seed}: capacity {capacity:.2f}/s, SLO {slo_s * 1e3:.0f} ms")
            for load in LOADS:
                peers = [peer for peer in PEERS if load in PEER_LOADS[peer]]
                turn = seed % len(peers)
                for peer in peers[turn:] + peers[:turn]:
                    config = LoadConfig(
                        url=servers[_server_of(peer)].url + "/v1/images/generations",
                        rate=load * capacity,
                        # Exactly the nominal count: a Poisson count would move the load
                        # of a run this short by tens of percent.
                        count=max(1, round(load * capacity * duration_s)),
                        duration_s=duration_s,
                        slo_s=slo_s,
                        seed=seed,
                        give_up_fraction=GIVE_UP_FRACTION,
                        give_up_s=(0.0, GIVE_UP_SLO * slo_s),
                        size=SIZE,
                        steps=steps,
                    )
                    run = _measure(options, servers[_server_of(peer)], _peer_config(peer, config))
                    run |= {"capacity_rps": capacity, "slo_s": slo_s, "rate": config.rate}
                    runs.setdefault(f"{peer}_{_label(load)}", []).append(run)
                    elapsed = time.perf_counter() - started
                    _log(f"seed {seed}, {peer} at {_label(load)}: {elapsed:.1f} s")
        # Again after the runs: how far the machine's speed drifted meanwhile.
        solo_end = _solo(servers, steps, solo_repeats, warm_up=False)
    return {
        "config": {
            "model": "tiny-sd",
            "size": SIZE,
            "steps": steps,
            "duration_s": duration_s,
            "seeds": list(seeds),
            "solo_repeats": solo_repeats,
            "loads": list(LOADS),
            "peer_loads": {peer: list(loads) for peer, loads in PEER_LOADS.items()},
            "give_up_fraction": GIVE_UP_FRACTION,
            "give_up_span_slo": [0.0, GIVE_UP_SLO],
            "slo_over_solo": SLO_SOLO,
            "capacity_from": "1 / the naive server's median call time, before each seed",
            "calibration_requests": calibration,
            "priority": PRIORITY,
            "priority_share": PRIORITY_SHARE,
            "omni_trio_server": (
                "uvicorn in a thread of this process" if options.quick else "hypercorn (trio)"
            )
            + f", max_batch_size 4, --max-priority {PRIORITY}",
            "naive_server": (
                "uvicorn in a thread of this process" if options.quick else "uvicorn (asyncio)"
            )
            + ", the pipeline's call behind a lock in a worker thread",
            "load_backend": options.backend,
        },
        "solo_s": {name: {"median": solo_s[name], "values": solo[name]} for name in SERVERS},
        "solo_end_s": {
            name: {"median": statistics.median(solo_end[name]), "values": solo_end[name]}
            for name in SERVERS
        },
        "scale": {str(seed): scale.as_json() for seed, scale in scales.items()},
        # Medians over the seeds, for the heading and the plot.
        "capacity_rps": statistics.median(scale.capacity_rps for scale in scales.values()),
        "slo_s": statistics.median(scale.slo_s for scale in scales.values()),
        "runs": runs,
        "summary": _summary(runs, solo_s, scales, duration_s),
    }


def _floored(goodput: float, duration_s: float) -> float:
    """A goodput to divide by: at least one image per window, so that none stays finite."""
    return max(goodput, 1 / duration_s)


def _class_goodput(run: dict[str, Any], name: str) -> float:
    figures = run["by_priority"].get(name)
    return 0.0 if figures is None else float(figures["goodput_per_s"])


def _ratios(
    runs: dict[str, list[dict[str, Any]]], peer: str, label: str, duration_s: float, cls: str = ""
) -> list[float]:
    """``peer``'s goodput over naive's at ``label``, one per seed (``cls``: one class only)."""

    def goodput(run: dict[str, Any]) -> float:
        return _class_goodput(run, cls) if cls else float(run["goodput_per_s"])

    naive = {run["seed"]: run for run in runs[f"naive_{label}"]}
    return [
        goodput(run) / _floored(goodput(naive[run["seed"]]), duration_s)
        for run in runs[f"{peer}_{label}"]
    ]


def _pooled(seeded: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One peer and load over every seed: counts summed, goodput's spread, pooled latencies."""
    goodput = [float(run["goodput_per_s"]) for run in seeded]
    latencies = [
        value for run in seeded for values in run["latencies_s"].values() for value in values
    ]
    classes: dict[str, dict[str, Any]] = {}
    for name in sorted({name for run in seeded for name in run["by_priority"]}):
        members = [run["by_priority"].get(name) for run in seeded]
        classes[name] = {
            "requests": sum(m["requests"] for m in members if m),
            "good_images": sum(m["good_images"] for m in members if m),
            "goodput_per_s": statistics.median(_class_goodput(run, name) for run in seeded),
            "p99_latency_s": percentile(
                [v for run in seeded for v in run["latencies_s"].get(name, [])], 99
            ),
        }
    reasons: dict[str, int] = {}
    for run in seeded:
        for reason, count in run["refused_by_reason"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    return {
        "requests": sum(run["requests"] for run in seeded),
        "counts": {
            outcome: sum(run["counts"][outcome] for run in seeded)
            for outcome in seeded[0]["counts"]
        },
        "refused_by_reason": dict(sorted(reasons.items())),
        "good_images": sum(run["good_images"] for run in seeded),
        "goodput_per_s": statistics.median(goodput),
        "goodput_min": min(goodput),
        "goodput_max": max(goodput),
        "throughput_per_s": statistics.median(float(run["throughput_per_s"]) for run in seeded),
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
        "steps_after_give_up": sum(run["steps_after_give_up"] for run in seeded),
        "steps_after_estimated": any(run["steps_after_source"] == "estimate" for run in seeded),
        "by_priority": classes,
    }


def _summary(
    runs: dict[str, list[dict[str, Any]]],
    solo_s: dict[str, float],
    scales: dict[int, _Scale],
    duration_s: float,
) -> dict[str, Any]:
    def by_load(peer: str, pick: Callable[[list[float]], float], cls: str = "") -> dict[str, float]:
        return {
            _label(load): pick(_ratios(runs, peer, _label(load), duration_s, cls))
            for load in PEER_LOADS[peer]
        }

    pooled = {key: _pooled(seeded) for key, seeded in runs.items()}

    def each(key: str) -> dict[str, float]:
        return {name: float(run[key]) for name, run in pooled.items() if run[key] is not None}

    high = str(PRIORITY)
    median = statistics.median
    return {
        "goodput_ratio_over_naive": median(_ratios(runs, "omni_trio", "1x", duration_s)),
        "goodput_ratio_over_naive_by_load": by_load("omni_trio", median),
        "goodput_ratio_over_naive_min_by_load": by_load("omni_trio", min),
        "goodput_ratio_over_naive_max_by_load": by_load("omni_trio", max),
        "goodput_ratio_pooled_by_load": {
            _label(load): pooled[f"omni_trio_{_label(load)}"]["good_images"]
            / max(pooled[f"naive_{_label(load)}"]["good_images"], 1)
            for load in LOADS
        },
        "deadline_goodput_ratio_over_naive_by_load": by_load("omni_trio_deadline", median),
        "priority_goodput_ratio_over_naive_by_load": by_load("omni_trio_priority", median),
        "priority_clients_goodput_ratio_over_naive_by_load": by_load(
            "omni_trio_priority", median, high
        ),
        "naive_effective_load_by_load": {
            _label(load): statistics.median(
                float(run.get("effective_load", 0.0)) for run in runs[f"naive_{_label(load)}"]
            )
            for load in LOADS
        },
        "goodput_per_s": each("goodput_per_s"),
        "p50_latency_s": each("p50_latency_s"),
        "p99_latency_s": each("p99_latency_s"),
        "steps_after_give_up": each("steps_after_give_up"),
        "solo_latency_s": dict(solo_s),
        "capacity_rps_by_seed": {str(seed): scale.capacity_rps for seed, scale in scales.items()},
        "slo_s_by_seed": {str(seed): scale.slo_s for seed, scale in scales.items()},
    }


_LABELS = {
    "naive": "naive",
    "omni_trio": "omni_trio",
    "omni_trio_deadline": "omni_trio, deadline_ms = SLO",
    "omni_trio_priority": f"omni_trio, {PRIORITY_SHARE:.0%} send priority {PRIORITY}",
}


def _ms(value: float | None) -> str:
    return fmt(None if value is None else value * 1e3, 0)


def _spread(values: Sequence[float], digits: int = 2, unit: str = "") -> str:
    low, high = min(values), max(values)
    return f"{statistics.median(values):.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


def _rows(result: dict[str, Any]) -> list[tuple[float, str, dict[str, Any]]]:
    """(load, peer, pooled figures) in table order."""
    runs = result["runs"]
    return [
        (load, peer, _pooled(runs[f"{peer}_{_label(load)}"]))
        for load in result["config"]["loads"]
        for peer in PEERS
        if f"{peer}_{_label(load)}" in runs
    ]


def table_serve(result: dict[str, Any]) -> str:
    """The head; per load and peer; the ratios; the priority classes."""
    config = result["config"]
    summary = result["summary"]
    seeds = config["seeds"]
    duration_s = config["duration_s"]
    rows = []
    for load, peer, pooled in _rows(result):
        counts = pooled["counts"]
        refused = ", ".join(f"{n} x {r}" for r, n in pooled["refused_by_reason"].items())
        steps = fmt(pooled["steps_after_give_up"], 0)
        if pooled["steps_after_estimated"]:
            steps += " (est.)"
        rows.append(
            [
                _label(load),
                _LABELS[peer],
                str(pooled["requests"]),
                str(counts["completed"]),
                str(counts["gave_up"]),
                str(counts["refused"] + counts["error"]) + (f" ({refused})" if refused else ""),
                _spread([pooled["goodput_min"], pooled["goodput_per_s"], pooled["goodput_max"]]),
                fmt(pooled["throughput_per_s"], 2),
                _ms(pooled["p50_latency_s"]),
                _ms(pooled["p99_latency_s"]),
                steps,
            ]
        )
    solo = result["solo_s"]
    scale = result["scale"]
    capacities = ", ".join(f"{scale[str(seed)]['capacity_rps']:.2f}" for seed in seeds)
    slos = ", ".join(f"{scale[str(seed)]['slo_s'] * 1e3:.0f}" for seed in seeds)
    head = (
        f"Tiny SD, {config['size']}, {config['steps']} steps; solo latency after a warm-up"
        f" (medians of {config['solo_repeats']}): naive {solo['naive']['median'] * 1e3:.0f} ms,"
        f" omni_trio {solo['omni_trio']['median'] * 1e3:.0f} ms at the start,"
        f" {result['solo_end_s']['naive']['median'] * 1e3:.0f} and"
        f" {result['solo_end_s']['omni_trio']['median'] * 1e3:.0f} ms at the end. Before each"
        f" seed, {config['calibration_requests']} solo requests to the naive server set the"
        " scale: capacity = 1 / its median call time (seeds"
        f" {', '.join(map(str, seeds))}: {capacities} requests/s), SLO ="
        f" {config['slo_over_solo']:g}x its solo latency ({slos} ms). Arrivals (exactly"
        " rate x window, at Poisson moments) for"
        f" {duration_s:g} s per run, the same schedule for every peer of a seed;"
        f" {config['give_up_fraction']:.0%} of the clients give up within"
        f" 0-{config['give_up_span_slo'][1]:g}x the SLO of sending. Goodput and throughput in"
        " images/s of the arrival window, median over the seeds (min-max); counts summed over"
        " the seeds; latencies (ms) of completed requests, pooled; steps: denoise steps run for"
        " requests after their client had gone, summed. The naive server ignores `priority`"
        " and `deadline_ms`: its one run per load and seed is the peer of every omni_trio"
        " row.\n\n"
    )
    table = md_table(
        [
            "load",
            "peer",
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
    runs = result["runs"]
    ratio_rows = []
    for load in config["loads"]:
        label = _label(load)
        cells = [label, _spread(_ratios(runs, "omni_trio", label, duration_s), unit="x")]
        cells.append(f"{summary['goodput_ratio_pooled_by_load'][label]:.2f}x")
        for peer, cls in (
            ("omni_trio_deadline", ""),
            ("omni_trio_priority", ""),
            ("omni_trio_priority", str(config["priority"])),
        ):
            key = f"{peer}_{label}"
            cells.append(
                _spread(_ratios(runs, peer, label, duration_s, cls), unit="x")
                if key in runs
                else "-"
            )
        ratio_rows.append(cells)
    ratios = (
        "\nGoodput over naive's, per seed: median (min-max); pooled: good images summed over"
        " the seeds.\n\n"
        + md_table(
            [
                "load",
                "omni_trio / naive",
                "pooled",
                "deadlines / naive",
                "priorities / naive",
                f"priority-{config['priority']} clients / naive's",
            ],
            ratio_rows,
        )
    )
    high = str(config["priority"])
    class_rows = []
    for load, peer, pooled in _rows(result):
        if peer not in ("naive", "omni_trio_priority"):
            continue
        cells = [_label(load), _LABELS[peer]]
        for name in (high, DEFAULT_CLASS):
            figures = pooled["by_priority"].get(name)
            if figures is None:
                cells += ["0", "-", "-"]
                continue
            cells += [
                str(figures["requests"]),
                f"{figures['goodput_per_s']:.2f} ({figures['good_images']} good)",
                _ms(figures["p99_latency_s"]),
            ]
        class_rows.append(cells)
    classes = (
        f"\nThe {config['priority_share']:.0%} of clients that send priority {high} and the"
        " others (the same clients in both rows: the naive server ignores the field), summed"
        " and pooled over the seeds; goodput median over the seeds.\n\n"
        + md_table(
            [
                "load",
                "peer",
                f"priority {high}: sent",
                "goodput",
                "p99",
                "others: sent",
                "goodput",
                "p99",
            ],
            class_rows,
        )
    )
    seed_rows = []
    for load in config["loads"]:
        label = _label(load)
        by_seed = {
            peer: {run["seed"]: run for run in runs.get(f"{peer}_{label}", [])} for peer in PEERS
        }
        for seed in seeds:
            naive = by_seed["naive"][seed]
            cells = [label, str(seed), fmt(naive["rate"], 2), str(naive["requests"])]
            cells.append(fmt(naive.get("effective_load"), 2) + "x")
            cells.append(_ms(naive.get("service_s")))
            cells.append(fmt(naive["goodput_per_s"], 2))
            for peer in PEERS[1:]:
                run = by_seed[peer].get(seed)
                cells.append("-" if run is None else fmt(run["goodput_per_s"], 2))
            cells.append(fmt(naive.get("load_average_1m"), 1))
            seed_rows.append(cells)
    per_seed = (
        "\nPer seed: the naive server's effective load is the work sent in its own mean call"
        " time under this load (`/stats` busy time over calls) per second of the window: the"
        " load it really faced, where the nominal one assumes its call time at the seed's"
        " calibration. Load average: one minute, after the naive run.\n\n"
        + md_table(
            [
                "load",
                "seed",
                "rate /s",
                "sent",
                "naive's effective load",
                "naive call ms",
                "goodput naive",
                "omni_trio",
                "deadlines",
                "priorities",
                "load average",
            ],
            seed_rows,
        )
    )
    return head + table + ratios + per_seed + classes


def plot_serve(result: dict[str, Any], path: Path) -> None:
    """Goodput and p99 latency per load, one bar per peer."""
    loads = result["config"]["loads"]
    rows = {(load, peer): pooled for load, peer, pooled in _rows(result)}
    x = range(len(loads))
    width = 0.8 / len(PEERS)
    colors = {**PEER_COLORS, "omni_trio_deadline": "#2ca02c", "omni_trio_priority": "#9467bd"}
    with figure(path, columns=2, title="serve: open-loop load, 30% impatient clients") as (a, b):
        for i, peer in enumerate(PEERS):
            offset = (i - (len(PEERS) - 1) / 2) * width
            at = [j + offset for j, load in zip(x, loads, strict=True) if (load, peer) in rows]
            pooled = [rows[load, peer] for load in loads if (load, peer) in rows]
            color = colors[peer]
            a.bar(at, [r["goodput_per_s"] for r in pooled], width, color=color)
            p99 = [(r["p99_latency_s"] or 0.0) * 1e3 for r in pooled]
            b.bar(at, p99, width, color=color, label=_LABELS[peer])
        slo_ms = result["slo_s"] * 1e3
        b.axhline(
            slo_ms, color="#333333", linestyle="--", linewidth=1, label="SLO (median of the seeds)"
        )
        for ax, ylabel in ((a, "SLO goodput, images/s (median)"), (b, "p99 latency, ms")):
            ax.set_xticks(list(x), [_label(load) + " capacity" for load in loads])
            ax.set_ylabel(ylabel)
            ax.grid(axis="y", alpha=0.3)
        b.legend(fontsize=7)
