"""Hostile runner errors: data that never crashes, hangs or misleads the engine (L22, L23).

A runner's exception may be any object: one whose ``repr()``/``str()`` raise, one
that is falsy, one with a 100 MB or unpicklable payload, one whose traceback holds
tensors; a runner's states and images may raise from ``__del__``; a runner may
raise a ``BaseException`` that is not an ``Exception``. Each test names the request
that meets the fault ("bad"), checks that only it fails (or, for a
``BaseException``, that the engine dies and nothing hangs), that the next request
is served, and that nothing is left behind.

Determinism: ``GatedRunner`` subclasses fail at one call for the request "bad",
and their steps run only once the test opens the gate (for previews, once the
consumer reads); ``max_batch_size=1`` keeps "good" out of "bad"'s batch; every
test has a hang budget. ``__del__`` errors go through ``sys.unraisablehook``, which the test
replaces with a recorder (pytest would otherwise report them, as it reports any
unraisable exception, the engine's own included).
"""

from __future__ import annotations

import pickle
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio._failure import DETAIL_CHARS
from omni_trio.runners import RunnerCapabilities, StepCallback, StopRun
from omni_trio.testing import (
    ENGINE_THREAD_PREFIX,
    FakeRunner,
    FakeState,
    GatedRunner,
    assert_engine_idle,
    wait_until,
)
from tests.support.core import BUDGET, WorkerKilled, read_gated, req, solo_images

pytestmark = pytest.mark.anyio

CALLS = ("prepare", "step", "preview", "decode", "discard")
ONE_AT_A_TIME = ot.EngineConfig(max_batch_size=1)


class Unprintable(Exception):
    """repr() and str() raise."""

    def __repr__(self) -> str:
        raise ValueError("no repr for you")

    def __str__(self) -> str:
        raise ValueError("no str for you")


class UnprintableHard(Exception):
    """str() raises a BaseException."""

    def __str__(self) -> str:
        raise SystemExit("str() is not a place to exit")


class Falsy(Exception):
    """bool() is False, == raises, and it cannot be hashed."""

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        raise ValueError("no comparisons")


class Verbose(Exception):
    """str() is a megabyte of text that is not UTF-8 (lone surrogates)."""

    def __str__(self) -> str:
        return "\ud800 is not text. " * 50_000


class ChainBomb(Exception):
    """Reading __cause__ or __context__ raises."""

    @property
    def __cause__(self) -> BaseException | None:  # type: ignore[override]
        raise ValueError("no cause")

    @property
    def __context__(self) -> BaseException | None:  # type: ignore[override]
        raise ValueError("no context")


class ForgedOutputError(ot.InvalidOutputError):
    """The runner's own InvalidOutputError (a public class), whose str() raises."""

    def __str__(self) -> str:
        raise RuntimeError("the engine must not trust this message")


def group() -> BaseException:
    return ExceptionGroup("several", [Unprintable(), Falsy("inner")])


KINDS: dict[str, Callable[[], BaseException]] = {
    "unprintable": Unprintable,
    "unprintable_hard": UnprintableHard,
    "falsy": lambda: Falsy("falsy"),
    "verbose": Verbose,
    "chain_bomb": ChainBomb,
    "group": group,
    "forged_invalid_output": ForgedOutputError,
}


class RaisingRunner(GatedRunner):
    """Raises ``make()`` in the call ``where`` for the request "bad"; steps are gated."""

    def __init__(self, where: str, make: Callable[[], BaseException]) -> None:
        super().__init__()
        self.where = where
        self.make = make

    def _fault(self, call: str, request_id: str) -> None:
        if call == self.where and request_id == "bad":
            raise self.make()

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        self._fault("prepare", request_id)
        return super().prepare(request, request_id)

    def step(self, states: Sequence[FakeState]) -> None:
        for state in states:
            self._fault("step", state.request_id)
        super().step(states)

    def preview(self, state: FakeState) -> torch.Tensor:
        self._fault("preview", state.request_id)
        return super().preview(state)

    def decode(self, state: FakeState) -> torch.Tensor:
        self._fault("decode", state.request_id)
        return super().decode(state)

    def discard(self, state: FakeState) -> None:
        super().discard(state)  # the state is freed, then the call fails
        self._fault("discard", state.request_id)


async def start(bad: ot.RequestHandle, runner: GatedRunner, where: str) -> None:
    """Let the steps run; for a preview fault, only once "bad"'s events are read (L18)."""
    if where == "preview":
        await read_gated(bad, runner)
    else:
        runner.open_gate()


async def fail_bad_serve_good(
    engine: ot.Engine, runner: GatedRunner, where: str
) -> ot.RequestFailedError:
    """Run "bad" and "good"; return bad's error, check good's images."""
    bad = engine.submit(req(preview_every=1), request_id="bad")
    good = engine.submit(req(), request_id="good")
    async with bad, good:
        await start(bad, runner, where)
        with pytest.raises(ot.RequestFailedError) as info:
            await bad.result()
        failed = info.value
        output = await good.result()
        torch.testing.assert_close(output.images, solo_images(req()))
    return failed


def assert_safe_message(error: BaseException, start: str) -> None:
    """str() and repr() of ``error`` work, start as expected, are bounded and UTF-8."""
    text = str(error)
    assert text.startswith(start), text
    assert len(text) < DETAIL_CHARS + 200, len(text)
    text.encode("utf-8")
    repr(error).encode("utf-8")


@pytest.mark.parametrize("where", CALLS)
@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_hostile_exception_fails_only_its_request(kind: str, where: str) -> None:
    """L22: whatever the exception, only its request fails, its message is safe, all is freed."""
    runner = RaisingRunner(where, KINDS[kind])
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ONE_AT_A_TIME) as engine:
            failed = await fail_bad_serve_good(engine, runner, where)
            assert type(failed.__cause__) is type(KINDS[kind]())
            assert failed.request_id == "bad"
            name = type(failed.__cause__).__name__
            assert_safe_message(failed, f"request 'bad' failed: the runner's {where} raised {name}")
            # The engine serves on.
            await engine.generate(req(seed=5))
            stats = engine.statistics()
            assert (stats.failed, stats.completed) == (1, 2)
            assert runner.live_states == 0
            assert_engine_idle(engine)


async def test_unprintable_exception_message_says_so() -> None:
    """L22: an exception whose str() raises is named by its type, its text replaced."""
    runner = RaisingRunner("step", Unprintable)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ONE_AT_A_TIME) as engine:
            failed = await fail_bad_serve_good(engine, runner, "step")
    assert str(failed) == (
        "request 'bad' failed: the runner's step raised Unprintable: <exception str() failed>"
    )


class Payload(Exception):
    """Carries 100 MB, a lambda and a lock: huge and unpicklable."""

    def __init__(self) -> None:
        super().__init__("heavy")
        self.blob = bytes(100 * 2**20)
        self.function = lambda: None
        self.lock = threading.Lock()


async def test_heavy_unpicklable_exception_is_freed_with_its_handle() -> None:
    """L22, L12: a 100 MB unpicklable cause is kept while its handle is open, then freed."""
    runner = RaisingRunner("step", Payload)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ONE_AT_A_TIME) as engine:
            async with engine.submit(req(), request_id="bad") as bad:
                runner.open_gate()
                with pytest.raises(ot.RequestFailedError) as info:
                    await bad.result()
                cause = info.value.__cause__
                del info
                assert isinstance(cause, Payload)
                with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
                    pickle.dumps(cause)
                assert bad.status is ot.RequestStatus.FAILED
                held = weakref.ref(cause)
                del cause
                assert held() is not None  # the open handle keeps its outcome
            assert held() is None  # closing it let go of the 100 MB
            await engine.generate(req())
            assert runner.live_states == 0
            assert_engine_idle(engine)


def frames(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


class TensorHoldingRunner(FakeRunner):
    """Raises from a step whose frames (and whose cause's frames) hold tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref[torch.Tensor]] = []

    def _inner(self) -> None:
        scratch = torch.zeros(1024)
        self.tensors.append(weakref.ref(scratch))
        raise KeyError("inner")

    def step(self, states: Sequence[FakeState]) -> None:
        batch = torch.cat([state.latents for state in states])
        self.tensors.append(weakref.ref(batch))
        try:
            self._inner()
        except KeyError as exc:
            raise RuntimeError("outer") from exc


async def test_traceback_keeps_no_tensor_and_no_engine_alive() -> None:
    """L22: the cause's frames are cleared (chain included) and the engine's own are cut."""
    runner = TensorHoldingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(), request_id="bad") as bad:
                with pytest.raises(ot.RequestFailedError) as info:
                    await bad.result()
                cause = info.value.__cause__
                assert isinstance(cause, RuntimeError)
                assert isinstance(cause.__cause__, KeyError)
                # While the error is held, the tensors its frames named are gone.
                assert len(runner.tensors) == 2
                assert all(ref() is None for ref in runner.tensors)
                # The runner's frames stay for the display; the engine's do not.
                names = [tb.tb_frame.f_code.co_name for tb in frames(cause.__traceback__)]
                assert names == ["step"]
                inner = [tb.tb_frame.f_code.co_name for tb in frames(cause.__cause__.__traceback__)]
                assert inner == ["step", "_inner"]
                for error in (cause, cause.__cause__):
                    for tb in frames(error.__traceback__):
                        assert "omni_trio/_" not in tb.tb_frame.f_code.co_filename
                assert "outer" in "".join(traceback.format_exception(info.value))
            assert runner.live_states == 0


class DelError(Exception):
    """What a runner object's __del__ raises."""


# The threads that doomed objects died in (module-level: the objects are gone).
STATE_DEATHS: list[str] = []
IMAGE_DEATHS: list[str] = []


class DoomedState(FakeState):
    """A state whose __del__ raises, noting the thread it dies in."""

    def __del__(self) -> None:
        STATE_DEATHS.append(threading.current_thread().name)
        raise DelError("state")


class DoomedImages(torch.Tensor):
    """Images whose __del__ raises, noting the thread they die in."""

    def __del__(self) -> None:
        IMAGE_DEATHS.append(threading.current_thread().name)
        raise DelError("images")


class DoomingRunner(FakeRunner):
    """Returns doomed states and images; the step fails for the request "bad"."""

    def prepare(self, request: ot.GenerationRequest, request_id: str) -> FakeState:
        state = super().prepare(request, request_id)
        return DoomedState(state.request_id, state.latents, state.prompt_code, 0, state.total)

    def step(self, states: Sequence[FakeState]) -> None:
        if any(state.request_id == "bad" for state in states):
            raise RuntimeError("bad step")
        super().step(states)

    def decode(self, state: FakeState) -> torch.Tensor:
        return super().decode(state).as_subclass(DoomedImages)


@pytest.fixture
def unraisables(monkeypatch: pytest.MonkeyPatch) -> list[tuple[type[BaseException], str]]:
    """Record (type, thread) of every unraisable exception during the test.

    Only those two: keeping the hook's arguments would keep the dying object alive.
    """
    seen: list[tuple[type[BaseException], str]] = []

    def hook(unraisable: Any) -> None:
        seen.append((unraisable.exc_type, threading.current_thread().name))

    monkeypatch.setattr(sys, "unraisablehook", hook)
    STATE_DEATHS.clear()
    IMAGE_DEATHS.clear()
    return seen


async def test_del_errors_of_runner_objects_stay_in_engine_threads(
    unraisables: list[tuple[type[BaseException], str]],
) -> None:
    """L22: states and images whose __del__ raises die in the engine's threads, reported there.

    The consumer gets a plain tensor; the only unraisable exceptions are the
    runner's own (one per doomed object), never one of the engine's.
    """
    runner = DoomingRunner()
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ONE_AT_A_TIME) as engine:
            bad = engine.submit(req(), request_id="bad")
            good = engine.submit(req(), request_id="good")
            async with bad, good:
                with pytest.raises(ot.RequestFailedError, match="bad step"):
                    await bad.result()
                output = await good.result()
                assert type(output.images) is torch.Tensor
                torch.testing.assert_close(output.images, solo_images(req()))
            assert runner.live_states == 0
            assert_engine_idle(engine)
    # Two states (bad's, good's) and one image batch (good's), all in engine threads.
    assert len(STATE_DEATHS) == 2
    assert len(IMAGE_DEATHS) == 1
    assert all(name.startswith(ENGINE_THREAD_PREFIX) for name in STATE_DEATHS + IMAGE_DEATHS)
    assert sorted(kind.__name__ for kind, _ in unraisables) == ["DelError"] * 3
    assert all(name.startswith(ENGINE_THREAD_PREFIX) for _, name in unraisables)


class Fatal(BaseException):
    """Not an Exception, and unprintable too."""

    def __repr__(self) -> str:
        raise ValueError("no repr")

    def __str__(self) -> str:
        raise ValueError("no str")


FATALS: dict[str, Callable[[], BaseException]] = {
    "keyboard_interrupt": KeyboardInterrupt,
    "system_exit": SystemExit,
    "unprintable": Fatal,
}


@pytest.mark.parametrize("where", CALLS)
@pytest.mark.parametrize("kind", sorted(FATALS))
async def test_base_exception_kills_the_worker_and_nothing_hangs(kind: str, where: str) -> None:
    """L23: a BaseException from any runner call kills the worker: all fail, nothing hangs.

    Live requests, later submits and the exit raise ``EngineDeadError`` with the
    runner's exception as cause and a message that is safe to print; the runner is
    closed and holds no state.
    """
    make = FATALS[kind]
    runner = RaisingRunner(where, make)
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.EngineDeadError) as exit_info:
            async with ot.open_engine(runner, ONE_AT_A_TIME) as engine:
                bad = engine.submit(req(preview_every=1), request_id="bad")
                good = engine.submit(req(), request_id="good")
                async with bad, good:
                    await start(bad, runner, where)
                    for handle in (bad, good):
                        with pytest.raises(ot.EngineDeadError) as info:
                            await handle.result()
                        assert type(info.value.__cause__) is make
                        assert handle.status is ot.RequestStatus.FAILED
                        assert_safe_message(info.value, "the engine")
                with pytest.raises(ot.EngineDeadError):
                    engine.submit(req())
        assert type(exit_info.value.__cause__) is make
        assert_safe_message(exit_info.value, "the engine")
        assert runner.closed
        assert runner.live_states == 0


class WholeCall(FakeRunner):
    """A whole-call runner: ``run`` loops over the steps itself, calling ``on_step``.

    ``behaviour`` for the request "bad": ``"stop"`` raises ``StopRun`` on its own at
    step 1; ``"swallow"`` catches every ``StopRun`` and runs on; previews of "bad"
    break the output contract (NaN) when ``bad_preview``.
    """

    def __init__(self, behaviour: str, *, bad_preview: bool = False) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.bad_preview = bad_preview
        self._capabilities = RunnerCapabilities(
            max_batch_size=1, can_join=False, previews=True, whole_call=True
        )

    def run(self, state: FakeState, on_step: StepCallback) -> None:
        for step in range(state.total):
            self.step([state])
            if state.request_id == "bad" and self.behaviour == "stop" and step == 0:
                raise StopRun
            try:
                on_step()
            except StopRun:
                if state.request_id != "bad" or self.behaviour != "swallow":
                    raise

    def preview(self, state: FakeState) -> torch.Tensor:
        preview = super().preview(state)
        if state.request_id == "bad" and self.bad_preview:
            return torch.full_like(preview, float("nan"))
        return preview


async def run_whole_call(runner: WholeCall, *, read: bool) -> BaseException:
    """Run "bad" (reading its events when ``read``), then "good"; return bad's error."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(req(preview_every=1), request_id="bad") as bad:
                if read:
                    async for _ in bad:
                        pass
                with pytest.raises(ot.OmniTrioError) as info:
                    await bad.result()
            output = await engine.generate(req(), request_id="good")
            torch.testing.assert_close(output.images, solo_images(req()))
            stats = engine.statistics()
            assert (stats.failed, stats.aborted, stats.completed) == (1, 0, 1)
            assert runner.live_states == 0
            assert runner.decodes == 1  # "good" only
    return info.value


async def test_whole_call_runner_stopping_itself_is_a_failure_not_a_shutdown() -> None:
    """L22: a StopRun the engine did not ask for fails the request; nothing says shutdown."""
    error = await run_whole_call(WholeCall("stop"), read=False)
    assert type(error) is ot.RequestFailedError
    assert str(error).startswith("request 'bad' failed: the runner's run raised StopRun")


async def test_whole_call_runner_swallowing_the_stop_for_a_bad_preview_still_fails() -> None:
    """L24: a runner that swallows the StopRun raised for a bad preview is not decoded."""
    error = await run_whole_call(WholeCall("swallow", bad_preview=True), read=True)
    assert type(error) is ot.RequestFailedError
    assert isinstance(error.__cause__, ot.InvalidOutputError)
    assert "NaN" in str(error)


class DiscardKills(GatedRunner):
    """``discard`` of "bad0" frees its state, then raises a BaseException (L23)."""

    def discard(self, state: FakeState) -> None:
        super().discard(state)
        if state.request_id == "bad0":
            raise WorkerKilled("discard")


async def test_dying_discard_frees_the_other_dropped_states() -> None:
    """L23: when a discard kills the worker, the other members dropped with it are freed."""
    runner = DiscardKills()
    with anyio.fail_after(BUDGET):
        with pytest.raises(ot.EngineDeadError):
            async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
                handles = [engine.submit(req(num_steps=4), request_id=f"bad{i}") for i in range(3)]
                # Whoever the worker took first is at the gate of step 1; the others
                # join at the next boundary, so at the second gate all three run.
                await wait_until(lambda: runner.arrived >= 1)
                runner.release(1)
                await wait_until(lambda: runner.arrived >= 2)
                assert [h.status for h in handles] == [ot.RequestStatus.RUNNING] * 3
                for handle in handles:
                    handle.abort_nowait()
                runner.open_gate()
                for handle in handles:
                    with pytest.raises(ot.OmniTrioError):
                        await handle.result()
                for handle in handles:
                    await handle.aclose()
    assert runner.live_states == 0
