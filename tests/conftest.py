"""Shared fixtures.

Determinism rules for every test module here:
- behaviour tests are marked ``pytest.mark.anyio`` and run on trio and asyncio
  (the ``anyio_backend`` fixture below); trio-only timing tests are marked
  ``pytest.mark.trio`` and take pytest-trio's ``autojump_clock``; no test has both;
- the runners are ``FakeRunner`` (instant) or ``GatedRunner`` (each step waits for
  the test's ``release``); nothing sleeps to let time pass;
- every test has a hang budget: ``anyio.fail_after(BUDGET)`` inside, and the
  pytest-timeout limit of pyproject.toml around it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from omni_trio.testing import assert_no_engine_threads

# The shared helpers assert too: give their failures pytest's detailed messages.
pytest.register_assert_rewrite("tests.support")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep what must not run at once on one worker of ``pytest -n`` (scripts/check.sh
    runs two, ``--dist loadgroup``): each module's tests together (a module-scoped
    fixture, a parallel group or a Ray cluster, starts once), the Ray tests of every
    module in one group (one local cluster at a time), and the parallel groups' modules
    in one (their ranks' collectives each get a core's share)."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            group = "ray"
        elif item.nodeid.startswith("tests/parallel/"):
            group = "parallel"
        else:
            group = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _own_state_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test has its own state folder: ``serve``'s default ``--jobs-dir`` (L77) is
    there, never in the user's home, and no test sees another's jobs."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``anyio`` test on both backends."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _no_engine_threads_left() -> Iterator[None]:
    """Every test must leave no engine thread behind (L35)."""
    yield
    assert_no_engine_threads()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread: batched and solo runs add in a fixed order, timings are stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
