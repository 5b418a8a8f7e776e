"""Every test here may start a group, whose ranks each load a model: on a busy 2-core
machine that alone can take a minute or two, so the hang budget is pytest's 120 s
raised to 300 s (a hung collective still fails well within it: the tests give
collectives 30 s)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test of this folder the budget of a group start."""
    for item in items:
        if "tests/parallel/" in item.nodeid:
            item.add_marker(pytest.mark.timeout(300))
