"""The warm-up (``ServeConfig.warm_up``): a shape measured warm before the first client (L4).

``EngineConfig.max_step_s`` refuses a request whose one step would outlast it, by what a
worker measured of warm steps of shapes no larger than the request's; before such a
shape is measured, it admits. The warm-up runs one request of the default size inside
the lifespan, enough steps to measure it warm, so the first client's request is bounded.

Determinism: the fake runner sleeps 50 ms per step (at least: a sleep never ends
early), so the 16 x 16 warm-up's warm steps measure at least 50 ms, over the bound of
40 ms, however busy the machine: a request of 16 x 16 or more is refused, and one of
8 x 8 (smaller than any shape measured) is admitted.
"""

from __future__ import annotations

import dataclasses
import io
import logging

import anyio
import pytest
import torch
from PIL import Image

import omni_trio as ot
from omni_trio.runners import RunnerCapabilities
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve._warmup import WARM_UP_ID, warm_up_request
from omni_trio.testing import FakeRunner, probe_engine
from tests.support.core import BUDGET
from tests.support.serve import PixelWork, serving

pytestmark = pytest.mark.anyio

SMALL = 16
LARGE = "256x256"


#: The bound on one step: under the fake runner's 50 ms steps.
BOUND_S = 0.04


def service(*, warm_up: bool, runner: FakeRunner | None = None) -> Service:
    """A 16 x 16 image service on a fake runner of 50 ms steps, its steps bounded at 40 ms."""
    config = ServeConfig(
        model_name="fake", default_width=SMALL, default_height=SMALL, default_steps=2,
        warm_up=warm_up,
    )  # fmt: skip
    return Service(
        runner if runner is not None else FakeRunner(step_seconds=0.05),
        engine_config=ot.EngineConfig(max_step_s=BOUND_S),
        config=config,
    )


async def test_the_warm_up_bounds_the_first_clients_step() -> None:
    """L4 (amended): with the warm-up, the first client's request whose one step would
    outlast ``max_step_s`` is a 400 naming ``size``, the bound and what was measured (the
    warm-up's shape, smaller than it); a request smaller than every shape measured is
    served; the warm-up was one request of three steps (one cold, two warm). Without it,
    the same first request is admitted and holds the worker for its whole step.
    """
    runner = FakeRunner(step_seconds=0.05)
    warmed = service(warm_up=True, runner=runner)
    with anyio.fail_after(BUDGET):
        async with serving(warmed) as client:
            engine = warmed.engine
            assert engine is not None
            stats = engine.statistics()
            assert (stats.admitted, stats.completed, runner.steps_run) == (1, 1, 3)
            large = await client.post(
                "/v1/images/generations", json={"prompt": "a fox", "size": LARGE}
            )
            assert large.status_code == 400, large.text
            error = large.json()["error"]
            assert error["param"] == "size", error
            assert "max_step_s of 0.04 s" in error["message"]
            assert "a smaller step (256 pixels)" in error["message"]
            assert "of 2 warm steps here" in error["message"]
            small = await client.post(
                "/v1/images/generations", json={"prompt": "a fox", "size": "8x8"}
            )
            assert small.status_code == 200, small.text
            assert engine.statistics().admitted == 2
    cold = service(warm_up=False)
    with anyio.fail_after(BUDGET):
        async with serving(cold) as client:
            engine = cold.engine
            assert engine is not None and engine.statistics().admitted == 0
            large = await client.post(
                "/v1/images/generations",
                json={"prompt": "a fox", "size": LARGE, "num_inference_steps": 1},
            )
            assert large.status_code == 200, large.text


class EditingRunner(FakeRunner):
    """The fake runner, taking an input image (edits)."""

    @property
    def capabilities(self) -> RunnerCapabilities:
        return dataclasses.replace(super().capabilities, image_input=True)


async def test_an_edit_whose_step_would_outlast_max_step_s_decodes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """L4 (amended), L76: an edit whose one step would outlast ``max_step_s`` is a 400
    naming ``size`` and the bound before its upload is decoded or resized, and a video
    job whose step would is a 400 naming its frames before it takes a place (both routes
    check what ``submit`` checks, the measured step time too)."""
    upload = io.BytesIO()
    Image.new("RGB", (SMALL, SMALL), (10, 200, 30)).save(upload, format="PNG")
    edits = service(warm_up=True, runner=EditingRunner(step_seconds=0.05))
    with anyio.fail_after(BUDGET):
        async with serving(edits) as client:
            work = PixelWork(monkeypatch)
            large = await client.post(
                "/v1/images/edits",
                files=[("image", ("image.png", upload.getvalue(), "image/png"))],
                data={"prompt": "a fox", "size": LARGE},
            )
            assert large.status_code == 400, large.text
            error = large.json()["error"]
            assert error["param"] == "size" and "max_step_s of 0.04 s" in error["message"]
            assert work.done == (0, 0)
            engine = edits.engine
            assert engine is not None and engine.statistics().admitted == 1  # the warm-up
    videos = service(warm_up=True, runner=FakeRunner(step_seconds=0.05, frames=(4, 1)))
    with anyio.fail_after(BUDGET):
        async with serving(videos) as client:
            body = {"prompt": "a fox", "size": "64x64", "num_frames": 9}
            long = await client.post("/v1/videos", json=body)
            assert long.status_code == 400, long.text
            error = long.json()["error"]
            assert error["param"] == "num_frames" and "max_step_s of 0.04 s" in error["message"]
            assert videos.videos.counts() == dict.fromkeys(videos.videos.counts(), 0)
            listed = await client.get("/v1/videos")
            assert listed.json()["data"] == []


async def test_a_failed_warm_up_is_one_log_line_and_the_server_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A model that fails its warm-up is one line of the server's log (the exception's
    type; the engine's own line says how it failed) and the service starts: ``/health``
    answers."""
    failing = service(warm_up=True, runner=FakeRunner(fail_at_step=1))
    with anyio.fail_after(BUDGET), caplog.at_level(logging.INFO, logger="omni_trio.serve"):
        async with serving(failing) as client:
            assert (await client.get("/health")).status_code == 200
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "omni_trio.serve" and "warm-up" in r.getMessage()
    ]
    assert lines == ["warm-up request failed (RequestFailedError); serving without it"]


def test_the_warm_up_is_the_cheapest_request_that_measures_a_step_warm() -> None:
    """L4 (amended): three steps (one cold, two warm; more where the model's fewest are
    more, fewer where its most are fewer) at the default size (a fixed size where the model
    has one); one frame under a 4k + 1 rule, 8 under 8k; a grey picture of that size for
    image to video."""
    config = ServeConfig(default_width=32, default_height=48)
    plain = warm_up_request(RunnerCapabilities(min_steps=2), config)
    assert (plain.num_steps, plain.width, plain.height, plain.num_frames) == (3, 32, 48, None)
    assert plain.image is None
    assert warm_up_request(RunnerCapabilities(min_steps=5), config).num_steps == 5
    assert warm_up_request(RunnerCapabilities(max_steps=2), config).num_steps == 2
    fixed = warm_up_request(RunnerCapabilities(fixed_size=(64, 80)), config)
    assert (fixed.height, fixed.width) == (64, 80)
    assert warm_up_request(RunnerCapabilities(frames=(4, 1)), config).num_frames == 1
    assert warm_up_request(RunnerCapabilities(frames=(8, 0)), config).num_frames == 8
    i2v = warm_up_request(
        RunnerCapabilities(frames=(4, 1), image_input=True, image_to_video=True), config
    )
    assert isinstance(i2v.image, torch.Tensor) and i2v.image.shape == (3, 48, 32)
    assert torch.equal(i2v.image, torch.full((3, 48, 32), 0.5))
    assert WARM_UP_ID == "omni_trio-warm-up"


class CompiledFake(FakeRunner):
    """A fake runner that says it runs compiled blocks, and records its seal (L90)."""

    compiled_blocks = 1

    def __init__(self) -> None:
        super().__init__()
        self.sealed = False

    def seal_compile(self) -> None:
        self.sealed = True


@pytest.mark.parametrize("compiled", [False, True])
async def test_the_warm_up_runs_each_declared_size_and_seals_a_compiled_model(
    compiled: bool,
) -> None:
    """L4 (amended), L90: with ``warm_up_sizes`` the warm-up runs each declared size (each
    measured warm); a compiled model's each alone and two at once (its batch graphs), then
    its runner is sealed, before the server answers."""
    runner = CompiledFake() if compiled else FakeRunner()
    config = ServeConfig(
        model_name="fake", default_width=SMALL, default_height=SMALL, default_steps=2,
        warm_up=True, warm_up_sizes=((16, 16), (8, 8)),
    )  # fmt: skip
    service = Service(runner, engine_config=ot.EngineConfig(max_batch_size=4), config=config)
    with anyio.fail_after(BUDGET):
        async with serving(service):
            engine = service.engine
            assert engine is not None
            [worker] = probe_engine(engine).workers
            assert engine.statistics().completed == (6 if compiled else 2)
            assert sorted(worker.step_times) == [64, 256]
    assert isinstance(runner, CompiledFake) is compiled
    if isinstance(runner, CompiledFake):
        assert runner.sealed
    with pytest.raises(ValueError, match="warm_up_sizes"):
        ServeConfig(warm_up_sizes=((16, 0),))
