"""The suite's own scheduling over ``pytest -n`` workers (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import worker_group as group_of


def test_every_ray_test_and_every_parallel_one_is_in_its_group(
    request: pytest.FixtureRequest,
) -> None:
    """Every test marked ``ray`` runs in the one ``ray`` group (one local cluster at a
    time), every test of tests/parallel/ in ``parallel``, and any other test with its
    module (its module-scoped fixtures start once)."""
    items = request.session.items
    for item in items:
        group = group_of(item.nodeid)
        if item.get_closest_marker("ray") is not None:
            assert group == "ray", item.nodeid
        elif item.nodeid.startswith("tests/parallel/"):
            assert group == "parallel", item.nodeid
        elif group not in ("ray", "parallel"):
            assert group == item.nodeid.split("::")[0], item.nodeid
    assert group_of("tests/test_bench.py::test_docs_page_renders_from_the_results") == (
        "tests/test_bench.py"
    )
