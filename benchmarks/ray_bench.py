"""``ray``: a Ray Serve replica vs plain ``omni-trio serve``: cost per request, disconnects.

The same fake model (``step_seconds`` 0: the figures are the serving path's own)
behind two servers: ``omni_trio.serve.ray.deployment`` with one replica on a local
Ray cluster (loopback), and the plain service (the app ``serve`` builds) under
Uvicorn in a thread of this process. Sequential requests of one step, interleaved
per round; the added cost is the median latency difference.

Disconnect-abort latency: a streaming request (10 ms steps) is read until step 3,
then its connection is closed; the time until the replica's ``/metrics`` counts it
``disconnected`` (polled every 5 ms, each poll a request through the proxy, so the
figure is an upper bound), and the steps the replica ran after the abort.

``--quick`` measures nothing (it writes a result that says so, in under a second):
starting Ray takes tens of seconds on a busy 2-core machine, too long for the
``all --quick`` smoke run.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .common import Options, fmt, md_table
from .plot import figure

__all__ = ["plot_ray", "run_ray", "table_ray"]

PATH = "/v1/images/generations"
BODY = {"prompt": "a flower", "num_inference_steps": 1, "size": "64x64"}
ABORT_STEP_S = 0.01


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.005)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _latency(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    answer = client.post(url + PATH, json=BODY)
    elapsed = time.perf_counter() - started
    assert answer.status_code == 200, answer.text
    return elapsed


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _abort_once(url: str) -> tuple[float, float]:
    """Disconnect one streaming request at step 3: (close to counted, steps after abort)."""
    gone = _metric(url, "omni_trio_requests_total", outcome="disconnected")
    after = _metric(url, "omni_trio_steps_after_abort_total")
    body = {**BODY, "num_inference_steps": 1000, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", url + PATH, json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data:") and '"step":3' in line:
                break
        closed = time.perf_counter()
    _wait(lambda: _metric(url, "omni_trio_requests_total", outcome="disconnected") > gone, 30)
    counted = time.perf_counter() - closed
    _wait(lambda: _metric(url, "omni_trio_requests_running") == 0, 30)
    return counted, _metric(url, "omni_trio_steps_after_abort_total") - after


def run_ray(options: Options) -> dict[str, Any]:
    """Measure both servers (see the module docstring); ``--quick`` measures nothing."""
    if options.quick:
        return {"summary": {"skipped_in_quick": 1}, "skipped": "Ray starts in tens of seconds"}
    import uvicorn

    from omni_trio.cli._ray import RAY_ENVIRONMENT

    for name, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    import ray
    from ray import serve

    from omni_trio.serve import ServeConfig
    from omni_trio.serve._options import ServiceOptions, build_service
    from omni_trio.serve.ray import deployment

    rounds, abort_runs = 200, 10
    serve_config = ServeConfig(model_name="fake", default_width=64, default_height=64)
    results: dict[str, list[float]] = {"plain": [], "ray": []}
    aborts: list[tuple[float, float]] = []
    plain_port, ray_port = _free_port(), _free_port()
    plain_url, ray_url = f"http://127.0.0.1:{plain_port}", f"http://127.0.0.1:{ray_port}"
    # Built as each replica builds its own: the peers differ in how they serve it only.
    service = build_service(
        ServiceOptions(model="fake", step_seconds=0).with_serve_config(serve_config)
    )
    server = uvicorn.Server(
        uvicorn.Config(service.app, host="127.0.0.1", port=plain_port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="plain-serve", daemon=True)
    thread.start()
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
        serve.run(
            deployment("fake", step_seconds=0, serve_config=serve_config),
            name="bench",
            route_prefix="/",
        )
        _wait(lambda: _healthy(plain_url) and _healthy(ray_url), 120)
        with httpx.Client(timeout=30) as client:
            for _ in range(20):  # warm-up
                _latency(client, plain_url)
                _latency(client, ray_url)
            for _ in range(rounds):
                results["plain"].append(_latency(client, plain_url))
                results["ray"].append(_latency(client, ray_url))
        serve.delete("bench")
        serve.run(
            deployment("fake", step_seconds=ABORT_STEP_S, serve_config=serve_config),
            name="abort",
            route_prefix="/",
        )
        aborts = [_abort_once(ray_url) for _ in range(abort_runs)]
        serve.shutdown()
    finally:
        ray.shutdown()
        server.should_exit = True
        thread.join(timeout=30)
    medians = {name: statistics.median(values) * 1e3 for name, values in results.items()}
    counted = [a[0] * 1e3 for a in aborts]
    return {
        "rounds": rounds,
        "latency_ms": {
            name: {"median": medians[name], "min": min(v) * 1e3, "max": max(v) * 1e3}
            for name, v in results.items()
        },
        "samples_ms": {name: [v * 1e3 for v in values] for name, values in results.items()},
        "abort_counted_ms": counted,
        "abort_steps_after": [a[1] for a in aborts],
        "summary": {
            "ray_overhead_ms_per_request": medians["ray"] - medians["plain"],
            "plain_median_ms": medians["plain"],
            "ray_median_ms": medians["ray"],
            "disconnect_counted_p50_ms": statistics.median(counted),
            "disconnect_counted_max_ms": max(counted),
            "steps_after_abort_max": max(a[1] for a in aborts),
        },
    }


def table_ray(result: dict[str, Any]) -> str:
    """The latencies of both servers, then the disconnect aborts."""
    if "skipped" in result:
        return f"Skipped: {result['skipped']} (run without --quick).\n"
    rows = [
        [name, fmt(v["median"]), fmt(v["min"]), fmt(v["max"])]
        for name, v in result["latency_ms"].items()
    ]
    s = result["summary"]
    text = md_table(["server", "median ms", "min ms", "max ms"], rows)
    text += (
        f"\nRay Serve adds {s['ray_overhead_ms_per_request']:.2f} ms per request"
        f" ({result['rounds']} one-step requests each, interleaved).\n\n"
    )
    text += md_table(
        ["disconnect at step 3", "p50 ms", "max ms", "steps after abort (max)"],
        [
            [
                f"{ABORT_STEP_S * 1e3:g} ms steps",
                fmt(s["disconnect_counted_p50_ms"]),
                fmt(s["disconnect_counted_max_ms"]),
                fmt(s["steps_after_abort_max"], 0),
            ]
        ],
    )
    return text + "\n"


def plot_ray(result: dict[str, Any], path: Path) -> None:
    """Latency distributions of both servers."""
    with figure(path, title="one-step requests: plain serve vs a Ray Serve replica") as (ax,):
        if "skipped" in result:
            ax.text(0.5, 0.5, "skipped in --quick", ha="center")
            return
        samples = result["samples_ms"]
        ax.boxplot([samples["plain"], samples["ray"]], tick_labels=["plain", "ray"])
        ax.set_ylabel("latency (ms)")
