"""Checkpoints of a running request (L78): taken at boundaries, restored in a fresh engine.

Determinism: ``every_s=0`` takes a checkpoint at every step boundary (no clock is
read to decide); the sink collects them in the materializer thread, and the test
reads them once the request ended. Outputs are compared exactly: the fake runner's
and tiny Wan's (one torch thread) resumed runs redo the same arithmetic.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET, req

pytestmark = pytest.mark.anyio


class Collected:
    """A sink: every checkpoint the engine hands it, in order (called from its thread)."""

    def __init__(self) -> None:
        self.items: list[ot.Checkpoint] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, checkpoint: ot.Checkpoint) -> None:
        with self._lock:
            self.items.append(checkpoint)
            self.threads.add(threading.current_thread().name)


async def run(
    runner: ot.abc.Runner[Any],
    request: ot.GenerationRequest,
    *,
    sink: Collected | None = None,
    resume_from: bytes | None = None,
) -> ot.GenerationOutput:
    policy = None if sink is None else ot.CheckpointPolicy(every_s=0, sink=sink)
    async with ot.open_engine(runner) as engine:
        handle = engine.submit(request, checkpoint=policy, resume_from=resume_from)
        async with handle:
            return await handle.result()


def frames(output: ot.GenerationOutput) -> torch.Tensor:
    assert output.video is not None
    return output.video


async def test_a_checkpoint_at_step_k_resumes_in_a_fresh_engine_to_the_same_output() -> None:
    """L78: a checkpoint after every step but the last; a fresh engine resumed from the one
    after step k runs only the remaining steps, and its images equal the uninterrupted run's.
    """
    request = req(num_steps=5)
    sink = Collected()
    with anyio.fail_after(BUDGET):
        whole = await run(FakeRunner(checkpoints=True), request, sink=sink)
        assert [c.step for c in sink.items] == [1, 2, 3, 4]
        assert {c.total for c in sink.items} == {5}
        assert all(name.endswith("-materializer") for name in sink.threads), sink.threads
        fresh = FakeRunner(checkpoints=True)
        resumed = await run(fresh, request, resume_from=sink.items[1].data)
    assert (fresh.restores, fresh.steps_run) == (1, 3)
    assert torch.equal(resumed.images, whole.images)


@pytest.mark.parametrize(
    "damage",
    ["cut", "flipped", "other request", "other model", "other version"],
)
async def test_a_corrupt_or_foreign_checkpoint_is_refused_and_the_request_starts_at_step_0(
    damage: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L78: a checkpoint cut short, altered, of another request, model or omni_trio version
    is refused with a log line naming the request; it runs from step 0 to the same output.
    """
    request = req(num_steps=4)
    sink = Collected()
    with anyio.fail_after(BUDGET):
        whole = await run(FakeRunner(checkpoints=True), request, sink=sink)
        data = sink.items[0].data
        if damage == "cut":
            data = data[:-5]
        elif damage == "flipped":
            data = data[:-1] + bytes([data[-1] ^ 1])
        elif damage == "other request":
            other = Collected()
            await run(FakeRunner(checkpoints=True), req(num_steps=4, seed=9), sink=other)
            data = other.items[0].data
        elif damage == "other model":
            monkeypatch.setattr("omni_trio.testing._fake._MODEL_KEY", "another")
        else:
            monkeypatch.setattr("omni_trio._version.__version__", "0.0.0-other")
        fresh = FakeRunner(checkpoints=True)
        with caplog.at_level(logging.WARNING, logger="omni_trio.worker"):
            resumed = await run(fresh, request, resume_from=data)
    assert (fresh.restores, fresh.steps_run) == (0, 4)
    assert torch.equal(resumed.images, whole.images)
    refused = [r for r in caplog.records if "is refused" in r.getMessage()]
    assert len(refused) == 1 and "step 0" in refused[0].getMessage()


async def test_checkpoints_need_a_runner_that_takes_them() -> None:
    """L78: a checkpoint policy or a resume on a runner without ``checkpoints`` is refused
    at submit, naming ``checkpoint``."""
    sink = Collected()
    async with ot.open_engine(FakeRunner()) as engine:
        for kwargs in ({"checkpoint": ot.CheckpointPolicy(every_s=1, sink=sink)},
                       {"resume_from": b"x"}):  # fmt: skip
            with pytest.raises(ot.InvalidRequestError) as caught:
                engine.submit(req(), **kwargs)
            assert caught.value.field == "checkpoint"
    with pytest.raises(ValueError, match="every_s"):
        ot.CheckpointPolicy(every_s=-1, sink=sink)


@pytest.mark.usefixtures("one_torch_thread")
async def test_tiny_wan_resumed_from_a_checkpoint_equals_its_uninterrupted_video() -> None:
    """L78: tiny Wan, 4 steps: resumed in a fresh engine (a fresh runner on a pipeline of the
    same seed) from the checkpoint after step 2, its video equals the uninterrupted one.
    A request with a step cache takes no checkpoints (logged once), and still completes.
    """
    request = ot.GenerationRequest(
        prompt="a fox", width=32, height=32, num_steps=4, num_frames=5, seed=3
    )
    sink = Collected()
    with anyio.fail_after(BUDGET):
        whole = await run(DiffusersRunner(tiny_pipeline("wan")), request, sink=sink)
        assert [c.step for c in sink.items] == [1, 2, 3]
        resumed = await run(
            DiffusersRunner(tiny_pipeline("wan")), request, resume_from=sink.items[1].data
        )
        assert torch.equal(frames(resumed), frames(whole))
        cached = Collected()
        policy = ot.StepCache(kind="first-block", threshold=0.05)
        await run(DiffusersRunner(tiny_pipeline("wan")), ot.GenerationRequest(
            prompt="a fox", width=32, height=32, num_steps=3, num_frames=5, seed=3, cache=policy,
        ), sink=cached)  # fmt: skip
    assert cached.items == []


def test_a_models_checkpoint_key_names_its_weights_not_the_process() -> None:
    """L78: two tiny Wan pipelines of one seed (built as two processes build them) share a
    checkpoint key; another seed's weights have another one, so their checkpoints differ."""
    from omni_trio.runners._checkpoint import model_key

    keys = [model_key("wan", tiny_pipeline("wan", seed=seed)) for seed in (0, 0, 1)]
    assert keys[0] == keys[1] != keys[2]
