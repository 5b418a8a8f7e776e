"""What a test may see of one admitted request beyond its handle, and one race to inject.

A ``RequestHandle`` shows what a consumer needs. A test also needs a few facts that
only the engine's side of the request knows: whether something already asked the
engine to end it (before it is terminal), whether the engine's threads still hold
its runner state, whether a consumer iterates its events. ``probe(handle)`` gives
exactly those, read-only, and keeps reading them after the handle was dropped.

``cancel_at_delivery`` makes the race between a consumer's cancellation and the
delivery of its result deterministic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .._outputs import RequestStatus

if TYPE_CHECKING:
    from .._handle import RequestHandle
    from .._record import Record

__all__ = ["RequestProbe", "cancel_at_delivery", "probe"]


class RequestProbe:
    """A read-only view of one admission's engine-side state; see ``probe``.

    It follows the admission, not the id: after the id was reused it still reads
    the old request. Every read is of the state now, from the event loop's thread.
    """

    __slots__ = ("_record",)

    def __init__(self, record: Record) -> None:
        self._record = record

    def __repr__(self) -> str:
        return f"<RequestProbe {self.request_id!r} {self.status.value}>"

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._record.request_id

    @property
    def status(self) -> RequestStatus:
        """The request's status now, as its handle would say."""
        return self._record.status

    @property
    def cancel_reason(self) -> str | None:
        """Why something asked the engine to end the request early, the moment it asked.

        An ``AbortReason`` (``"user"``, ``"consumer_gone"``, ``"cancelled"``,
        ``"shutdown"``, ``"deadline"``, ...) or the reason given to an abort;
        ``None`` while nothing asked. Unlike
        ``RequestHandle.abort_reason`` it is set before the request is terminal,
        and stays set when the request ended otherwise (the first reason wins).
        """
        return self._record.token.reason

    @property
    def steps_done(self) -> int:
        """The denoising steps the worker finished for it so far."""
        return self._record.steps_done

    @property
    def holds_state(self) -> bool:
        """Whether the engine's threads still hold its runner state (L8, L11).

        False before the worker prepared it and once the state was discarded; a
        dead worker never hands its states back.
        """
        return self._record.state is not None

    @property
    def reading(self) -> bool:
        """Whether a consumer has started iterating the handle's events (L18)."""
        return self._record.reading


def probe(handle: RequestHandle) -> RequestProbe:
    """Return a read-only view of ``handle``'s request, beyond what the handle shows.

    The view keeps the request's record alive as long as the view lives (not its
    handle: dropping the handle still frees the id, L14).
    """
    return RequestProbe(handle._record)


class _CancelOnDelivery:
    """Stands in for a record's ``done`` event: cancels ``scope`` as the outcome lands."""

    def __init__(self, event: anyio.Event, scope: anyio.CancelScope, *, before: bool) -> None:
        self._event = event
        self._scope = scope
        self._before = before

    def set(self) -> None:
        if self._before:
            self._scope.cancel()
        self._event.set()
        if not self._before:
            self._scope.cancel()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


def cancel_at_delivery(
    handle: RequestHandle, scope: anyio.CancelScope, *, before: bool = False
) -> None:
    """Cancel ``scope`` in the very callback that makes ``handle``'s request terminal.

    The cancellation reaches a consumer waiting in ``result()`` inside ``scope``
    together with its outcome, before its task runs again: the race between a
    cancellation and a delivery, made deterministic (L11, L15). Call it right after
    ``submit``, before anything waits for the request.

    Args:
        handle: the request's handle.
        scope: the scope to cancel.
        before: cancel just before the request becomes terminal rather than just
            after; either way in the same callback.
    """
    record = handle._record
    record.done = _CancelOnDelivery(record.done, scope, before=before)  # type: ignore[assignment]
