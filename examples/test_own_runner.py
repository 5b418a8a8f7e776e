"""Test your own runner: the engine's checks from omni_trio.testing, cases from Hypothesis.

``FadeRunner`` is a toy model written against ``omni_trio.abc`` alone: each step fades
seeded noise one step closer to grey. The property: for any list of step counts and
any set of requests aborted right after admission, on a batching engine, every
request ends exactly once (its image, or ``RequestAbortedError``), a completed image
equals the one computed alone, an aborted request was never decoded (L10), the engine
is idle at the end and the runner holds no state (L8, L14). Run as a script it checks
40 cases; ``pytest examples/test_own_runner.py`` collects the same test.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import omni_trio as ot
from omni_trio.abc import RunnerCapabilities
from omni_trio.testing import assert_engine_idle, check_engine_invariants


@dataclass(slots=True, kw_only=True)
class FadeState:
    request_id: str
    image: torch.Tensor
    total: int
    done: int = 0


def noise(request: ot.GenerationRequest) -> torch.Tensor:
    generator = torch.Generator().manual_seed(request.seed or 0)
    shape = (request.num_images, 3, request.height, request.width)
    return torch.rand(shape, generator=generator)


def fade(image: torch.Tensor, total: int, done: int) -> torch.Tensor:
    """One step: ``done`` steps of ``total`` are behind this one."""
    return image + (0.5 - image) / (total - done)


class FadeRunner:
    """Batches up to four requests; requests join a running batch at any step."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.decoded: set[str] = set()

    @property
    def capabilities(self) -> RunnerCapabilities:
        return RunnerCapabilities(max_batch_size=4, can_join=True)

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FadeState:
        self.held.add(request_id)
        return FadeState(request_id=request_id, image=noise(request), total=request.num_steps)

    def step(self, states: Sequence[FadeState]) -> None:
        for state in states:
            state.image = fade(state.image, state.total, state.done)
            state.done += 1

    def preview(self, state: FadeState) -> torch.Tensor | None:
        return None

    def decode(self, state: FadeState) -> torch.Tensor:
        self.decoded.add(state.request_id)
        return state.image.clamp(0, 1)

    def discard(self, state: FadeState) -> None:
        self.held.discard(state.request_id)

    def close(self) -> None:
        pass


def alone(request: ot.GenerationRequest) -> torch.Tensor:
    image = noise(request)
    for done in range(request.num_steps):
        image = fade(image, request.num_steps, done)
    return image.clamp(0, 1)


async def check(steps: list[int], aborted: set[int]) -> None:
    runner = FadeRunner()
    requests = [
        ot.GenerationRequest(prompt="x", num_steps=n, height=8, width=8, seed=i)
        for i, n in enumerate(steps)
    ]
    with anyio.fail_after(10):  # a hang budget: a bug fails, never hangs
        async with ot.open_engine(runner) as engine:
            handles = [engine.submit(r, request_id=f"r{i}") for i, r in enumerate(requests)]
            for i in aborted:
                engine.abort_nowait(f"r{i}")
            for i, handle in enumerate(handles):
                async with handle:
                    try:
                        output = await handle.result()
                    except ot.RequestAbortedError:
                        assert f"r{i}" not in runner.decoded
                    else:
                        assert torch.allclose(output.images, alone(requests[i]), atol=1e-6)
                    check_engine_invariants(engine)
            assert_engine_idle(engine)
    assert runner.held == set()


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    aborted=st.sets(st.integers(0, 5), max_size=3),
)
def test_every_request_ends_once_and_nothing_is_left(steps: list[int], aborted: set[int]) -> None:
    anyio.run(check, steps, {i for i in aborted if i < len(steps)}, backend="trio")


if __name__ == "__main__":
    test_every_request_ends_once_and_nothing_is_left()
    print("40 cases: every request ended once, images as alone, nothing left")
