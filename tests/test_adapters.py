"""The adapters a request names, as data (L85): checked at construction and at admission."""

from __future__ import annotations

import dataclasses
import math
import pickle

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
