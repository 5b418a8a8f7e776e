"""The steps each family's scheduler runs, declared and refused at admission (L4).

Every tiny family declares ``min_steps`` and ``max_steps`` from its scheduler's
config (``runners._diffusers.step_bounds``): a request at the bound is admitted and
runs; one past it is refused by ``check_request`` naming ``num_steps``, before any
work. The facts behind the bounds are pinned too: one step past a bound fails
inside diffusers' scheduler, which is why it is refused.

Determinism: tiny pipelines with seeded weights, built once; one torch thread; the
runs are short and ungated (nothing here races).
"""

from __future__ import annotations

import warnings

import anyio
import pytest

import omni_trio as ot
from omni_trio.abc import RunnerCapabilities
from omni_trio.runners import DiffusersRunner
from tests.support.core import BUDGET
from tests.support.runners import KINDS, request, tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: What each family's scheduler runs, as measured with diffusers 0.42: flow matching
#: with a terminal shift (Qwen-Image, LTX-Video) from 2 steps; DDIM over 1,000
#: training timesteps, with "leading" spacing's offset of 1 on SD and SDXL, up to
#: 999 (1,000 on the unconditional UNet, offset 0); flow matching has no upper bound.
BOUNDS: dict[str, tuple[int, int | None]] = {
    "sd": (1, 999),
    "sdxl": (1, 999),
    "sd3": (1, None),
    "flux": (1, None),
    "qwen-image": (2, None),
    "unet": (1, 1000),
    "wan": (1, None),
    "ltx": (2, None),
}


def capabilities(kind: str) -> RunnerCapabilities:
    runner = DiffusersRunner(tiny(kind))
    runner.close()
    return runner.capabilities


def refused_field(kind: str, steps: int) -> str:
    """The field ``check_request`` names for a request of ``steps``."""
    with pytest.raises(ot.InvalidRequestError) as info:
        capabilities(kind).check_request(request(kind, num_steps=steps))
    assert str(steps) in str(info.value)
    assert info.value.field is not None
    return info.value.field


@pytest.mark.parametrize("kind", KINDS)
def test_each_family_admits_its_bounds_and_refuses_one_past_them(kind: str) -> None:
    """L4: the bounds are declared; at a bound a request passes, one past it is refused."""
    low, high = BOUNDS[kind]
    declared = capabilities(kind)
    assert (declared.min_steps, declared.max_steps) == (low, high)
    declared.check_request(request(kind, num_steps=low))
    if low > 1:
        assert refused_field(kind, low - 1) == "num_steps"
    if high is not None:
        declared.check_request(request(kind, num_steps=high))
        assert refused_field(kind, high + 1) == "num_steps"


def first_step(kind: str, steps: int) -> None:
    """Prepare a request of ``steps`` and run its first step alone, with no engine."""
    runner = DiffusersRunner(tiny(kind))
    state = runner.prepare(request(kind, num_steps=steps), "probe")
    try:
        runner.step([state])
    finally:
        runner.discard(state)
        runner.close()


@pytest.mark.parametrize(
    ("kind", "steps"),
    [(kind, high) for kind, (_, high) in BOUNDS.items() if high is not None]
    + [(kind, low) for kind, (low, _) in BOUNDS.items() if low > 1],
)
def test_a_bound_runs_and_one_past_it_fails_inside_the_scheduler(kind: str, steps: int) -> None:
    """L4: why the bounds: at one the scheduler steps, one past it diffusers fails.

    Only the first step runs (where a step past the training timesteps reads out of
    range, or one step's NaN sigmas fail): no full run of 1,000 steps.
    """
    first_step(kind, steps)
    past = steps + 1 if steps == BOUNDS[kind][1] else steps - 1
    with warnings.catch_warnings(), pytest.raises((IndexError, ValueError, RuntimeWarning)):
        # numpy's "invalid value" warning is the first sign of the NaN sigmas.
        warnings.simplefilter("error", RuntimeWarning)
        first_step(kind, past)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", [kind for kind, (low, _) in BOUNDS.items() if low > 1])
async def test_a_request_at_the_fewest_steps_completes(kind: str) -> None:
    """L4: at ``min_steps`` the family runs to a valid output (the engine checks it)."""
    low, _ = BOUNDS[kind]
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(DiffusersRunner(tiny(kind))) as engine:
            output = await engine.generate(request(kind, num_steps=low))
    assert output.metrics.steps_done == low
