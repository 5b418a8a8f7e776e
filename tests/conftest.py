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
from typing import Any

import pytest
import torch

from omni_trio.testing import assert_no_engine_threads

# The shared helpers assert too: give their failures pytest's detailed messages.
pytest.register_assert_rewrite("tests.support")


#: The modules whose tests all run on the session's PostgreSQL server.
POSTGRES_MODULES = ("/test_jobs_postgres.py", "/test_cluster_kill.py")


def worker_group(nodeid: str) -> str:
    """The group of ``pytest -n`` workers a test runs in, by its id: tests of one group
    run on one worker, one after another (scripts/check.sh runs two workers).

    Each module is a group (a module-scoped fixture, a parallel group or a Ray cluster,
    starts once), every Ray test is in one (one local cluster at a time), and so are the
    parallel ranks' modules (their ranks' collectives each get a core's share), and the
    tests on PostgreSQL (tests/support/postgres.py: one server per worker that uses it).
    """
    path, _, name = nodeid.partition("::")
    if path.endswith("/test_ray.py") or name.startswith("test_ray"):
        return "ray"
    if path.endswith(POSTGRES_MODULES) or "postgres" in name.partition("[")[2]:
        return "postgres"
    if path.startswith("tests/parallel/"):
        return "parallel"
    return path


#: The groups that take most of the suite's time (``pytest --durations``, 2026-12-06:
#: the ranks' modules about 400 s of a worker's time, the examples 200 s, the quick run
#: of every benchmark 140 s, Ray 130 s, the docs site 80 s), longest first. They are
#: collected first, so that ``pytest -n 2`` starts them first and the two workers end
#: together instead of one running a long group alone at the end (pytest without
#: coverage 951 -> 884 s, one run each; the check with coverage showed no gain).
LONGEST_GROUPS = (
    "parallel",
    "tests/test_examples.py",
    "tests/test_bench.py",
    "ray",
    "tests/test_site.py",
    "postgres",
    "tests/runners/test_fast_lifecycle.py",
    "tests/serve/test_jobs_kill.py",
    "tests/runners/test_compile.py",
    "tests/runners/test_quantize.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the ``LONGEST_GROUPS`` first, in that order; the rest keep theirs."""
    first = {group: index for index, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: first.get(worker_group(item.nodeid), len(first)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Schedule ``pytest -n`` by ``worker_group``. (xdist's own ``--dist loadgroup`` marks
    ids in a way pytest 9.2 ignores: its groups would be split.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class Groups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return Groups(config, log)


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
