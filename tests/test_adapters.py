"""The adapters a request names, as data (L85): checked at construction and at admission;
loads and unloads through the engine, over fake runners that keep only the names.

Determinism: the fake runners' loads are instant or raise at once; the engine's workers
are idle while the adapters change, and each test has a hang budget.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner
from tests.support.core import BUDGET, req


def test_a_request_stores_its_adapters_as_pairs_in_order() -> None:
    """L85: ``adapters`` is read once, as ``(name, scale)`` pairs in the order given."""
    given = {"ink": 0.8, "film": 1}
    r = req(adapters=given)
    given["ink"] = 5.0
    assert r.adapters == (("ink", 0.8), ("film", 1.0))
    assert r.adapter_pairs == r.adapters
    assert req(adapters=[("film", 0.5)]).adapters == (("film", 0.5),)
    assert req().adapters == ()
    assert req(adapters={"ink": 0.8}) == req(adapters=[["ink", 0.8]])


@pytest.mark.parametrize(
    "adapters",
    [
        {"": 1.0},
        {"../ink": 1.0},
        {"a" * 65: 1.0},
        {"ink": math.nan},
        {"ink": True},
        {"ink": 101.0},
        {"ink": "1"},
        [("ink", 1.0), ("ink", 0.5)],
        [("ink",)],
        "ink",
        {1: 1.0},
    ],
)
def test_a_bad_adapter_is_refused_naming_adapters(adapters: object) -> None:
    """L85: names, scales and the shape are checked when the request is built."""
    with pytest.raises(ot.InvalidRequestError) as caught:
        req(adapters=adapters)
    assert caught.value.field == "adapters"


@pytest.mark.anyio
async def test_a_runner_without_adapters_refuses_them_at_admission() -> None:
    """L85, L4: a runner declaring ``max_adapters`` 0 refuses any, naming ``adapters``;
    more than the bound is refused too."""
    assert ot.abc.RunnerCapabilities().max_adapters == 0
    with pytest.raises(ot.InvalidRequestError, match="at most 1") as caught:
        ot.abc.RunnerCapabilities(max_adapters=1).check_request(req(adapters={"a": 1, "b": 1}))
    assert caught.value.field == "adapters"
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            with pytest.raises(ot.InvalidRequestError, match="no adapters") as caught:
                engine.submit(req(adapters={"ink": 1.0}))
            assert caught.value.field == "adapters"
            with pytest.raises(ot.AdapterError) as refused:
                await engine.load_adapter("ink", "ink.safetensors")
            assert refused.value.reason == "invalid"
            assert engine.adapters() == ()


def test_an_adapter_error_pickles_with_its_reason() -> None:
    """L85: ``AdapterError`` keeps its ``reason`` and ``name`` through a pickle (Ray)."""
    error = ot.AdapterError("held", reason="in-use", name="ink")
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.reason, copy.name) == ("held", "in-use", "ink")


@pytest.mark.anyio
async def test_a_runner_that_claims_adapters_without_the_calls_is_refused() -> None:
    """L85: ``max_adapters`` without ``load_adapter`` (a wrapper that copied its inner
    runner's capabilities) stops ``open_engine``, never a submit later."""

    class Claims(FakeRunner):
        @property
        def capabilities(self) -> ot.abc.RunnerCapabilities:
            return dataclasses.replace(super().capabilities, max_adapters=1)

    with anyio.fail_after(BUDGET), pytest.raises(TypeError, match="load_adapter"):
        async with ot.open_engine(Claims()):
            pass


class Broken(BaseException):
    """What a runner raises once it cannot serve any more (as a parallel group whose rank
    died does): not an ``Exception``, so its worker dies of it (L23)."""


class Named(FakeRunner):
    """A ``FakeRunner`` that takes two adapters a request and keeps only their names;
    with ``breaks`` its loads raise ``Broken``."""

    def __init__(self, *, breaks: bool = False) -> None:
        super().__init__(step_seconds=0.0)
        self.breaks = breaks
        self.names: set[str] = set()

    @property
    def capabilities(self) -> ot.abc.RunnerCapabilities:
        return dataclasses.replace(super().capabilities, max_adapters=2)

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        if self.breaks:
            raise Broken("the group broke: rank 1 was killed by signal 9")
        if name in self.names:
            raise ot.AdapterError("loaded already", reason="exists", name=name)
        self.names.add(name)

    def unload_adapter(self, name: str) -> None:
        self.names.remove(name)

    def adapters(self) -> tuple[ot.AdapterInfo, ...]:
        return tuple(
            ot.AdapterInfo(name=name, bytes=8, holders=0, loaded=True, source=None)
            for name in sorted(self.names)
        )

    def adapter_names(self) -> frozenset[str]:
        return frozenset(self.names)


@pytest.mark.anyio
async def test_a_runner_that_breaks_in_a_load_ends_its_worker_and_the_load_is_engine_dead() -> None:
    """L85, L23: a runner whose load raises a ``BaseException`` that is not an
    ``Exception`` (a parallel group that broke) ends its worker as its own thread would:
    the load raises ``EngineDeadError`` (the runner's error its cause), never that
    ``BaseException``; the engine says it is dead at once, lists no adapter, refuses
    what comes next; and leaving it raises ``EngineDeadError`` (L23)."""
    runner = Named(breaks=True)
    with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError):
        async with ot.open_engine(runner) as engine:
            with pytest.raises(ot.EngineDeadError) as dead:
                await engine.load_adapter("ink", "ink.safetensors")
            assert isinstance(dead.value.__cause__, Broken)
            assert engine.statistics().is_dead and engine.adapters() == ()
            with pytest.raises(ot.EngineDeadError):
                await engine.load_adapter("film", "film.safetensors")
    assert runner.closed and not runner.names


@pytest.mark.anyio
async def test_a_runner_that_breaks_in_a_load_leaves_the_other_workers_serving_with_it() -> None:
    """L85, L43: of two workers, the one whose runner breaks in a load dies alone; the
    other loads the adapter and serves requests that name it."""
    good, broken = Named(), Named(breaks=True)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine([good, broken]) as engine:
            await engine.load_adapter("ink", "ink.safetensors")
            stats = engine.statistics()
            assert (stats.workers_alive, stats.is_dead) == (1, False)
            assert [info.name for info in engine.adapters()] == ["ink"]
            output = await engine.generate(req(adapters={"ink": 1.0}))
            assert output.images.shape[0] == 1
    assert good.names == {"ink"} and broken.closed
