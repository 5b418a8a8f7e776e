"""The public test helpers of omni_trio.testing."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio.testing import FakeRunner, GatedRunner, engine_threads

from .util import BUDGET, req, solo_images


def test_fake_runner_depends_only_on_the_request() -> None:
    """FakeRunner images depend on seed, prompt and steps, never on batch-mates."""
    base = req(num_steps=4, seed=3, prompt="p")
    runner = FakeRunner()
    states = [runner.prepare(r, str(i)) for i, r in enumerate([base, req(seed=9), base])]
    for _ in range(4):
        runner.step(states)
    torch.testing.assert_close(runner.decode(states[0]), solo_images(base), rtol=0, atol=0)
    torch.testing.assert_close(runner.decode(states[2]), solo_images(base), rtol=0, atol=0)
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=4, seed=4, prompt="p")))
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=4, seed=3, prompt="q")))
    assert not torch.equal(solo_images(base), solo_images(req(num_steps=5, seed=3, prompt="p")))
    images = solo_images(base)
    assert images.shape == (1, 3, 16, 16)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def test_fake_runner_counts_and_refuses_double_discard() -> None:
    """Counters follow the calls; discarding a state twice is a bug the runner reports."""
    runner = FakeRunner()
    state = runner.prepare(req(), "r")
    assert runner.live_states == 1
    runner.discard(state)
    assert runner.live_states == 0
    with pytest.raises(RuntimeError, match="twice"):
        runner.discard(state)


def test_gated_runner_times_out_instead_of_hanging() -> None:
    """A step nobody releases fails after gate_timeout rather than hanging the test."""
    runner = GatedRunner(gate_timeout=0.01)
    state = runner.prepare(req(), "r")
    with pytest.raises(RuntimeError, match="no release"):
        runner.step([state])


@pytest.mark.anyio
async def test_engine_threads_are_listed_while_open() -> None:
    """engine_threads() shows the engine's threads while it runs, none after."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            assert set(engine_threads()) == set(engine.threads)
            assert all(isinstance(t, threading.Thread) for t in engine.threads)
        assert engine_threads() == []
