"""Only the library makes an ``Engine`` or a ``RequestHandle``, and nobody subclasses them.

An engine built by hand has no worker thread and a handle built by hand has no
admitted request: both would accept calls that then wait forever. So both classes
refuse their public constructor with a ``TypeError`` that says how to get one, and
refuse subclassing. The ``type: ignore[misc]`` on each subclass below pins the
``@typing.final`` mark too: mypy (strict, with ``warn_unused_ignores``) reports the
ignore as unused once the mark is gone.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner, engine_threads
from tests.support.core import BUDGET, req


def test_engine_has_no_public_constructor() -> None:
    """Building an Engine by hand raises and starts no thread."""
    runner = FakeRunner()
    with pytest.raises(
        TypeError,
        match=r"^omni_trio\.Engine has no public constructor available; "
        r"get one from open_engine\(\)$",
    ):
        ot.Engine([runner], ot.EngineConfig())
    assert engine_threads() == []
    assert (runner.prepares, runner.closed) == (0, False)


def test_request_handle_has_no_public_constructor() -> None:
    """Building a RequestHandle by hand raises before it looks at its arguments."""
    anything: Any = object()
    with pytest.raises(
        TypeError,
        match=r"^omni_trio\.RequestHandle has no public constructor available; "
        r"get one from Engine\.submit\(\)$",
    ):
        ot.RequestHandle(anything, anything)


def test_engine_is_final() -> None:
    """Engine cannot be subclassed, and says so to type checkers and at run time."""
    assert getattr(ot.Engine, "__final__", False) is True
    with pytest.raises(TypeError, match=r"^omni_trio\.Engine does not support subclassing$"):

        class MyEngine(ot.Engine):  # type: ignore[misc]
            pass


def test_request_handle_is_final() -> None:
    """RequestHandle cannot be subclassed, and says so to type checkers and at run time."""
    assert getattr(ot.RequestHandle, "__final__", False) is True
    with pytest.raises(TypeError, match=r"^omni_trio\.RequestHandle does not support subclassing$"):

        class MyHandle(ot.RequestHandle):  # type: ignore[misc]
            pass


@pytest.mark.anyio
async def test_open_engine_and_submit_make_them() -> None:
    """The public ways still work: open_engine makes the engine, submit the handle."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            assert type(engine) is ot.Engine
            threads = engine.threads
            assert len(threads) == 2
            assert all(type(thread) is threading.Thread for thread in threads)
            assert set(threads) == set(engine_threads())
            async with engine.submit(req(), request_id="r") as handle:
                assert type(handle) is ot.RequestHandle
                output = await handle.result()
            assert output.request_id == "r"


def test_the_metaclass_needs_made_by() -> None:
    """A class under NoPublicConstructor must say how to get an instance."""
    from omni_trio._construct import NoPublicConstructor

    namespace: dict[str, Any] = {}
    with pytest.raises(TypeError, match="made_by"):
        NoPublicConstructor("Nameless", (), namespace)
