"""The seam between a ``RequestHandle`` and the engine that admitted its request.

A handle reads its ``Record`` directly (status, channel, outcome, ``done``) and asks
the engine for exactly three things, named here, so neither side reaches into the
other's private state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._handle import RequestHandle
    from ._record import Record

__all__ = ["RequestOwner"]


class RequestOwner(Protocol):
    """What a ``RequestHandle`` may ask of the engine that owns its record.

    Every call runs in the event loop's thread, returns at once and never raises
    for a reason that passed ``check_reason``. None is async, so none is a
    cancellation point: the handle does its waiting on ``Record.done`` itself,
    which the engine sets exactly when its threads hold nothing of the record any
    more (L8, L11).
    """

    def check_reason(self, reason: str) -> None:
        """Refuse an abort reason that a caller may not give.

        Raises:
            ValueError: ``reason`` is not a non-empty ``str``, or it is
                ``AbortReason.SHUTDOWN``, which only the engine's shutdown gives.
        """

    def abort(self, record: Record, reason: str) -> None:
        """End ``record`` early with ``reason``, which passed ``check_reason``.

        The first reason wins: nothing happens if the record is terminal or its
        token is set already. A waiting record is withdrawn and made ABORTED (its
        ``done`` set) before this returns (L6); a running one ends when the worker
        sees its token at the next step boundary (L7).
        """

    def forget(self, record: Record, handle: RequestHandle) -> None:
        """Free the id of terminal ``record``, whose ``handle`` just closed (L3).

        Nothing happens unless ``handle`` is the one the engine holds for that id,
        so a late call never frees an id that a newer request has taken.
        """
