"""RequestHandle: the consumer's side of one request."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, final

import anyio
import anyio.lowlevel

from ._construct import NoPublicConstructor
from ._outputs import GenerationOutput, RequestMetrics, RequestStatus, StepEvent
from ._reasons import AbortReason
from ._record import TAKEN, Record, wait_shielded

if TYPE_CHECKING:
    from ._owner import RequestOwner

__all__ = ["RequestHandle"]


def _fresh(error: BaseException) -> BaseException:
    """A new exception equal to the stored ``error``, to raise.

    Raising the stored one would give it a traceback through the caller's frames,
    which hold the handle: a cycle that keeps the handle, its record and its id
    alive until the garbage collector runs (L3, L14).
    """
    copy = type(error).__new__(type(error))
    copy.__dict__.update(error.__dict__)
    copy.args = error.args
    copy.__cause__ = error.__cause__
    return copy


def _leave_reason(exc: BaseException | None) -> AbortReason:
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return AbortReason.CANCELLED
    return AbortReason.CONSUMER_GONE


@final
class RequestHandle(metaclass=NoPublicConstructor, made_by="Engine.submit()"):
    """The consumer's side of one admitted request; ``Engine.submit`` makes it.

    Use it as an async context manager: leaving the ``async with`` block before the
    request is terminal aborts it (reason ``consumer_gone``, or ``cancelled`` when
    the block is left by cancellation) and returns only once the engine's threads
    let go of it (L11). Closing drops every buffered event and the output (L12).
    Iterating yields ``StepEvent``\\s until the request is terminal; ``result()``
    returns the output or raises the terminal error.

    Exceptions raised in the block propagate unchanged; the handle never wraps
    them in an exception group.
    """

    __slots__ = ("__weakref__", "_closed", "_owner", "_record")

    def __init__(self, owner: RequestOwner, record: Record) -> None:
        self._owner = owner
        self._record = record
        self._closed = False
        record.handle_ref = weakref.ref(self)

    def __repr__(self) -> str:
        return f"<RequestHandle {self.request_id!r} {self.status.value}>"

    def __del__(self) -> None:
        if not self._closed:
            warnings.warn(
                f"unclosed {self!r}: use 'async with engine.submit(...)' or aclose()",
                ResourceWarning,
                stacklevel=1,
                source=self,
            )

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._record.request_id

    @property
    def tenant(self) -> str | None:
        """The request's tenant (``GenerationRequest.tenant``, L58); ``None``: the default."""
        return self._record.request.tenant

    @property
    def status(self) -> RequestStatus:
        """The request's status now."""
        return self._record.status

    @property
    def abort_reason(self) -> str | None:
        """Why the request was aborted (an ``AbortReason``, or the reason given), else ``None``.

        ``AbortReason.SHUTDOWN`` when shutdown cut it off.
        """
        if self._record.status is RequestStatus.ABORTED:
            return self._record.token.reason
        return None

    @property
    def metrics(self) -> RequestMetrics | None:
        """The request's metrics, set once it is terminal (for every outcome)."""
        return self._record.metrics

    @property
    def is_closed(self) -> bool:
        """Whether the handle was closed."""
        return self._closed

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close(_leave_reason(exc))

    def __aiter__(self) -> AsyncIterator[StepEvent]:
        return self

    async def __anext__(self) -> StepEvent:
        """Return the next step event; stop once the request is terminal.

        Raises:
            anyio.ClosedResourceError: the handle is closed.

        Cancellation:
            Safe: no event is lost, the request goes on.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        self._record.reading = True
        try:
            return await self._record.channel.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def result(self) -> GenerationOutput:
        """Wait for the request to end; return its output or raise its error.

        The output is returned once; a second call raises ``RuntimeError``.

        Raises:
            RequestAbortedError: the request was aborted.
            RequestFailedError: the runner raised; ``__cause__`` is its exception.
            EngineClosedError: shutdown cut the request off.
            EngineDeadError: the engine's worker died.
            anyio.ClosedResourceError: the handle is closed.

        Cancellation:
            Cancelling the caller before the request is terminal aborts it
            (reason ``cancelled``) and returns only after its release (L11).
        """
        if self._closed:
            raise anyio.ClosedResourceError
        record = self._record
        if record.done.is_set():
            await anyio.lowlevel.checkpoint()
        else:
            try:
                await record.done.wait()
            except BaseException as exc:
                self._owner.abort(record, _leave_reason(exc))
                await wait_shielded(record.done)
                raise
        outcome = record.outcome
        if isinstance(outcome, GenerationOutput):
            record.outcome = TAKEN
            return outcome
        if isinstance(outcome, BaseException):
            raise _fresh(outcome)
        if outcome is TAKEN:
            raise RuntimeError(f"the output of request {self.request_id!r} was already returned")
        raise anyio.ClosedResourceError  # closed while this call waited

    def abort_nowait(self, *, reason: str = AbortReason.USER) -> bool:
        """Request the abort of this request; never blocks.

        Returns:
            Whether the request was live (not yet terminal) when called.
        """
        self._owner.check_reason(reason)
        record = self._record
        live = not record.status.is_terminal
        if live:
            self._owner.abort(record, reason)
        return live

    async def abort(self, *, reason: str = AbortReason.USER) -> bool:
        """Abort the request and wait until the engine released it.

        Returns:
            Whether the request was live (not yet terminal) when called.

        Cancellation:
            The abort stands; only the wait for the release is cancelled.
        """
        live = self.abort_nowait(reason=reason)
        await self._record.done.wait()
        return live

    async def aclose(self) -> None:
        """Close the handle: abort the request if it is live, then drop its data.

        Cancellation:
            Deferred until the engine released the request (one step at most).
        """
        await self._close(AbortReason.CONSUMER_GONE)

    async def _close(self, reason: str) -> None:
        record = self._record
        try:
            if not record.status.is_terminal:
                self._owner.abort(record, reason)
                await wait_shielded(record.done)
        finally:
            # Also when wait_shielded re-raises a deferred native cancellation.
            if not self._closed:
                self._closed = True
                record.channel.close_receive()
                record.outcome = None
                self._owner.forget(record, self)
        # A schedule point that cannot raise: closing must not fail halfway
        # because the caller is being cancelled.
        await anyio.lowlevel.cancel_shielded_checkpoint()
