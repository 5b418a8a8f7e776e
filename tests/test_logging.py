"""The library's log: one line per finished request, failures once with their traceback.

Determinism rules: instant fake runners (``FakeRunner``, step_seconds 0) or gated ones;
records captured by a handler of the test's own on ``omni_trio`` (it sees each record as
it is emitted, ``exc_info`` included); a hang budget on every test.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest

import omni_trio as ot
from omni_trio.testing import FakeRunner, GatedRunner, wait_until
from tests.support.core import BUDGET

pytestmark = pytest.mark.anyio


class Seen(logging.Handler):
    """Keeps each record and, as it was at emit time, its exception."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.exceptions: list[BaseException | None] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.exceptions.append(record.exc_info[1] if record.exc_info else None)

    def lines(self, name: str = "omni_trio.engine") -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in self.records if r.name == name]


@contextmanager
def seen() -> Iterator[Seen]:
    handler = Seen()
    library = logging.getLogger("omni_trio")
    level = library.level
    library.addHandler(handler)
    library.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        library.removeHandler(handler)
        library.setLevel(level)


def request(steps: int = 3, tenant: str | None = None) -> ot.GenerationRequest:
    return ot.GenerationRequest(prompt="x", num_steps=steps, width=64, height=64, tenant=tenant)


def test_the_library_adds_only_a_null_handler() -> None:
    """The application decides where the log goes: the library adds a NullHandler only."""
    handlers = logging.getLogger("omni_trio").handlers
    assert [type(h) for h in handlers if not isinstance(h, Seen)] == [logging.NullHandler]
    for name in ("omni_trio.engine", "omni_trio.worker", "omni_trio.serve"):
        assert logging.getLogger(name).handlers == []


async def test_a_completed_request_logs_one_info_line() -> None:
    """One INFO line per finished request: id, outcome, steps, queue wait, total."""
    with anyio.fail_after(BUDGET), seen() as log:
        async with ot.open_engine(FakeRunner()) as engine:
            await engine.generate(request(3), request_id="done-1")
        [record] = [r for r in log.records if r.name == "omni_trio.engine"]
        assert record.levelno == logging.INFO
        assert record.request_id == "done-1"  # type: ignore[attr-defined]
        message = record.getMessage()
        assert message.startswith("request done-1 completed: steps 3/3, queue wait ")
        assert " s, total " in message and "reason" not in message
        assert {m for _, m in log.lines("omni_trio.worker")} == {
            "omni-trio-" + m.split("omni-trio-")[1] for _, m in log.lines("omni_trio.worker")
        }  # the worker logs its start and end only, at DEBUG
        assert [lvl for lvl, _ in log.lines("omni_trio.worker")] == [logging.DEBUG] * 2


async def test_an_aborted_request_logs_its_reason_and_shutdown_warns() -> None:
    """An abort logs INFO with its reason; a request cut by shutdown logs a WARNING."""
    runner = GatedRunner()
    with anyio.fail_after(BUDGET), seen() as log:
        async with ot.open_engine(runner, ot.EngineConfig(shutdown_grace=0)) as engine:
            async with engine.submit(request(5), request_id="gone") as handle:
                await wait_until(lambda: handle.status is ot.RequestStatus.RUNNING)
                aborted = engine.abort("gone", reason="client left")
                runner.release(1)
                assert await aborted
            async with engine.submit(request(5), request_id="cut") as cut:
                await wait_until(lambda: cut.status is ot.RequestStatus.RUNNING)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(engine.aclose)
                    await wait_until(lambda: engine.statistics().is_closing)
                    runner.release(1)  # the step ends; the boundary sees the cut
        lines = log.lines()
        assert [lvl for lvl, _ in lines] == [logging.INFO, logging.WARNING]
        assert lines[0][1].startswith("request gone aborted: steps ")
        assert lines[0][1].endswith(", reason client left")
        assert lines[1][1].startswith("request cut aborted: steps 1/5,")
        assert lines[1][1].endswith(", reason shutdown")


async def test_a_requests_last_line_carries_its_tenant(caplog: pytest.LogCaptureFixture) -> None:
    """L56: a request's last line carries its tenant as ``record.tenant``, its name or
    ``None`` for the default tenant, whether it completed or was aborted (running or
    waiting)."""
    runner = GatedRunner()
    config = ot.EngineConfig(max_batch_size=1)
    with anyio.fail_after(BUDGET), caplog.at_level(logging.INFO, logger="omni_trio.engine"):
        async with ot.open_engine(runner, config) as engine:
            running = engine.submit(request(5, tenant="acme"), request_id="acme-aborted")
            waiting = engine.submit(request(5), request_id="default-aborted")
            async with running, waiting:
                await wait_until(lambda: running.status is ot.RequestStatus.RUNNING)
                assert waiting.status is ot.RequestStatus.WAITING  # one at a time
                assert engine.abort_nowait("default-aborted")
                assert engine.abort_nowait("acme-aborted")  # at its next step boundary
                runner.open_gate()
                for handle in (running, waiting):
                    with pytest.raises(ot.RequestAbortedError):
                        await handle.result()
            await engine.generate(request(tenant="acme"), request_id="acme-completed")
            await engine.generate(request(), request_id="default-completed")
    last: dict[str, logging.LogRecord] = {}
    for record in caplog.records:
        if record.name == "omni_trio.engine" and hasattr(record, "request_id"):
            last[record.request_id] = record
    assert {name: (r.outcome, r.tenant) for name, r in last.items()} == {  # type: ignore[attr-defined]
        "acme-aborted": ("aborted", "acme"),
        "default-aborted": ("aborted", None),
        "acme-completed": ("completed", "acme"),
        "default-completed": ("completed", None),
    }
    assert all(r.getMessage().startswith(f"request {name} ") for name, r in last.items())


async def test_a_failed_batch_logs_its_traceback_once_naming_every_request() -> None:
    """A runner's failure: one ERROR record with exc_info and the traceback text (formatted
    in the engine thread), naming every request of the batch; one INFO line per request."""
    runner = GatedRunner(fail_at_step=2)
    with anyio.fail_after(BUDGET), seen() as log:
        async with ot.open_engine(runner) as engine:
            first = engine.submit(request(3), request_id="a")
            second = engine.submit(request(3), request_id="b")
            async with first, second:
                # Both are in the batch by step 2 (b joins at step 1's boundary at the latest).
                runner.release(2)
                for handle in (first, second):
                    with pytest.raises(ot.RequestFailedError):
                        await handle.result()
        errors = [
            (r, e)
            for r, e in zip(log.records, log.exceptions, strict=True)
            if r.levelno == logging.ERROR
        ]
        assert len(errors) == 1
        record, exception = errors[0]
        assert record.name == "omni_trio.engine" and record.request_id == "a"  # type: ignore[attr-defined]
        assert record.request_ids == ("a", "b")  # type: ignore[attr-defined]
        assert isinstance(exception, RuntimeError)
        assert "failing at step 2" in str(record.exc_text)
        assert record.exc_text is not None and record.exc_text.startswith("Traceback")
        assert record.exc_info is None  # after the handlers ran: the text, not the object
        assert "(and b, of its batch)" in record.getMessage()
        finished = [m for lvl, m in log.lines() if lvl == logging.INFO]
        assert [m.split(":")[0] for m in finished] == ["request a failed", "request b failed"]
        assert all("error RequestFailedError: " in m for m in finished)


async def test_a_consumer_too_slow_for_its_events_is_warned_about() -> None:
    """A consumer that iterates but lets the channel drop events gets a WARNING line
    that says how many were dropped; one that never iterates does not."""
    config = ot.EngineConfig(event_buffer=1)
    with anyio.fail_after(BUDGET), seen() as log:
        async with ot.open_engine(FakeRunner(), config) as engine:
            async with engine.submit(request(6), request_id="slow") as handle:
                async for _ in handle:
                    break  # read one, then stop reading
                await handle.result()
            await engine.generate(request(6), request_id="quiet")
        lines = {m.split(" ")[1]: (lvl, m) for lvl, m in log.lines()}
        level, message = lines["slow"]
        assert level == logging.WARNING and "slow consumer: " in message
        dropped = int(message.split("slow consumer: ")[1].split(" ")[0])
        assert 1 <= dropped <= 5
        assert lines["quiet"][0] == logging.INFO and "slow consumer" not in lines["quiet"][1]
