"""Several devices behind one server (L42, L43): the options, the runners, a degraded health.

The app runs in its own lifespan (as in ``test_app``) on two fake runners;
one is killed by a BaseException from its step, and the server goes on serving
on the other, saying so in ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import anyio
import pytest

import omni_trio as ot
from omni_trio.runners import for_devices, visible_devices
from omni_trio.runners._devices import parse_devices
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._models import load_model
from omni_trio.testing import wait_until
from tests.support.cli import one_line_error, serve
from tests.support.core import BUDGET
from tests.support.devices import KillableRunner
from tests.support.serve import PATH, metric, serving


def test_device_lists_are_parsed_and_checked() -> None:
    """L42: a comma list, ``auto`` (the CPU on a machine without GPUs), repeated CPUs;
    an empty list, a bad name or an accelerator named twice is refused by name."""
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    assert parse_devices(["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert parse_devices("auto") == visible_devices()
    for bad, text in (("", "at least one"), ("nonsense", "not a torch device")):
        with pytest.raises(ValueError, match=text):
            parse_devices(bad)
    with pytest.raises(ValueError, match="cuda:0 is named twice"):
        parse_devices("cuda:0,cuda:0")
    assert for_devices(lambda device: device.upper(), "cpu,cpu") == ["CPU", "CPU"]


def test_load_model_builds_one_runner_per_device() -> None:
    """L42: ``serve --workers 2`` (and ``--devices``) load the model once per device."""
    fake = load_model("fake", step_seconds=0.0, devices=["cpu", "cpu"])
    assert len(fake.runners) == 2 and fake.runners[0] is not fake.runners[1]
    tiny = load_model("tiny-sd", step_seconds=0.0, devices=["cpu", "cpu"])
    assert len(tiny.runners) == 2 and "on cpu, cpu" in tiny.description
    assert tiny.runners[0].capabilities == tiny.runners[1].capabilities


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--devices", "cuda:0,cuda:0"], "--devices: cuda:0 is named twice"),
        (["--devices", "nonsense"], "--devices: 'nonsense' is not a torch device"),
        (["--workers", "0"], "argument --workers: expected an integer from 1 to 64"),
        (["--workers", "2", "--devices", "cpu"], "not allowed with argument"),
    ],
)
def test_bad_device_options_are_one_line_and_status_2(args: list[str], text: str) -> None:
    """L42: a bad ``--devices`` or ``--workers`` is one line on stderr and exit status 2."""
    one_line_error(serve("--model", "fake", "--port", "0", *args), 2, text)


@pytest.mark.anyio
async def test_health_and_metrics_say_degraded_when_a_worker_dies() -> None:
    """L43: with one of two workers dead, ``/health`` is 200 ``degraded`` and the server
    answers requests on the other; ``/metrics`` counts the workers and the live ones."""
    runners = [KillableRunner(), KillableRunner()]
    for runner in runners:
        runner.open_gate()
    service = Service(
        runners,
        engine_config=ot.EngineConfig(max_batch_size=1),
        config=ServeConfig(model_name="fake", default_width=64, default_height=64, default_steps=2),
    )
    with anyio.fail_after(BUDGET):
        async with serving(service) as client:
            assert (await client.get("/health")).json()["status"] == "ok"
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_workers") == metric(text, "omni_trio_workers_alive") == 2
            runners[0].kill = runners[1].kill = True
            # One request kills whichever worker takes it; then the other one is spared.
            failed = await client.post(PATH, json={"prompt": "x"})
            assert failed.status_code == 500
            engine = service.engine
            assert engine is not None
            await wait_until(lambda: engine.statistics().workers_alive == 1)
            alive = [w.alive for w in engine.statistics().workers].index(True)
            runners[alive].kill = False
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.json() == {
                "status": "degraded",
                "model": "fake",
                "workers_alive": 1,
                "workers": 2,
            }
            text = (await client.get("/metrics")).text
            assert metric(text, "omni_trio_workers") == 2
            assert metric(text, "omni_trio_workers_alive") == 1
            ok = await client.post(PATH, json={"prompt": "y"})
            assert ok.status_code == 200


def test_upload_limits_are_options() -> None:
    """L76: ``--max-upload-bytes`` and ``--max-upload-pixels`` reach the service's limits."""
    import argparse

    from omni_trio.cli._options import make_service, service_options
    from omni_trio.cli._serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        ["--model", "fake", "--max-upload-bytes", "1000", "--max-upload-pixels", "4096"]
    )
    service = make_service(service_options(args), load_model("fake", step_seconds=0.0))
    assert (service.upload_limits.max_bytes, service.upload_limits.max_pixels) == (1000, 4096)
