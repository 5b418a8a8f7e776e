"""The suite's own scheduling over ``pytest -n`` workers (tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.conftest import worker_group as group_of


def on_postgres(item: pytest.Item) -> bool:
    """Whether the test uses the session's PostgreSQL server (tests/support/postgres.py):
    by its fixture, or as the ``postgres`` store of the job stores' conformance tests."""
    params = getattr(item, "callspec", None)
    return "postgres" in getattr(item, "fixturenames", ()) or (
        params is not None and "postgres" in params.params.values()
    )


def test_every_ray_test_and_every_parallel_one_is_in_its_group(
    request: pytest.FixtureRequest,
) -> None:
    """Every test marked ``ray`` runs in the one ``ray`` group (one local cluster at a
    time), every test of tests/parallel/ in ``parallel``, every test on PostgreSQL in
    ``postgres`` (one server), and any other test with its module (its module-scoped
    fixtures start once)."""
    items = request.session.items
    for item in items:
        group = group_of(item.nodeid)
        if item.get_closest_marker("ray") is not None:
            assert group == "ray", item.nodeid
        elif item.nodeid.startswith("tests/parallel/"):
            assert group == "parallel", item.nodeid
        elif on_postgres(item):
            assert group == "postgres", item.nodeid
        elif group not in ("ray", "parallel", "postgres"):
            assert group == item.nodeid.split("::")[0], item.nodeid
    assert group_of("tests/test_bench.py::test_docs_page_renders_from_the_results") == (
        "tests/test_bench.py"
    )
