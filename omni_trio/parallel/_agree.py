"""Agreed cancel points (L48, L71): every rank leaves a step at the same point, or none does.

The engine decides, on rank 0 only, that a step is no longer wanted (every member
stopped): its check raises ``StopRun`` at rank 0's next cancel point (a block
boundary). A rank that left alone would break the group: the others would wait
in the step's next collective until the timeout. So the ranks agree, through two
64-bit flags in memory that every rank of the group maps (the ranks run on one
machine), written by rank 0 only and read by the others at every cancel point: a
read costs nanoseconds and no collective. How they agree depends on where the
step's collectives are:

- **split** (classifier-free guidance split): the only collective of a model call
  is the all-gather of its noise predictions, after the forward. Rank 0, leaving,
  writes the step's plan number into ``STOP`` and leaves its forward; every other
  rank leaves its own at its next cancel point once it reads it. Every rank then
  still makes the all-gather, with one number more: 1 if it left. If any rank
  left, every rank leaves the step, having made the same collectives. A rank that
  had finished its forward when rank 0 left simply says 0.
- **announced** (sequence parallel): a block's attention exchanges tokens with the
  other ranks, so no rank can leave inside it. Rank 0, at cancel point ``b``,
  announces "leave at cancel point ``b + 1``" in ``LEAVE`` and runs block ``b``.
  No other rank can have passed ``b + 1`` yet: that needs block ``b``'s
  exchanges, which rank 0 has not made; every rank reads the announcement when it
  gets there and leaves, rank 0 too. It costs one block more than leaving at
  once; a step whose last block the announcement overtakes simply finishes.

- **by load** (a sequence layout that splits by load): each model call is one
  or the other, chosen by every rank alike from the call's rows (``_rank``)
  before its first cancel point: the step's check holds both and the runner
  says which one a call uses (``choose``).

Both flags hold the plan number of the step they are about, so a value left from
an earlier step never fires.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, Literal, Protocol

from .._cancelpoint import current_check
from .._runner import StopRun

__all__ = ["LEAVE", "STOP", "Agreement", "Flags", "agreed_check", "choose", "new_flags"]

#: The flags: the step whose split is left; the step and cancel point to leave at.
STOP, LEAVE = 0, 1
#: ``LEAVE`` holds ``plan number << _SHIFT | cancel point``.
_SHIFT = 24
_POINT = (1 << _SHIFT) - 1

#: How a layout agrees (see the module doc).
Agreement = Literal["split", "announced", "by-load"]


class Flags(Protocol):
    """Two shared 64-bit integers (a ``multiprocessing`` ``RawArray`` of ``c_int64``)."""

    def __getitem__(self, index: int) -> int: ...

    def __setitem__(self, index: int, value: int) -> None: ...


def new_flags(context: Any) -> Flags:
    """Two zeroed flags in shared memory, from a ``multiprocessing`` context."""
    flags: Flags = context.RawArray(ctypes.c_int64, 2)
    return flags


class _Split:
    __slots__ = ("_engine", "_flags", "_seq")

    def __init__(self, flags: Flags, seq: int, engine: Callable[[], None] | None) -> None:
        self._flags = flags
        self._seq = seq
        self._engine = engine

    def __call__(self) -> None:
        if self._engine is None:
            if self._flags[STOP] == self._seq:
                raise StopRun
            return
        try:
            self._engine()
        except StopRun:
            self._flags[STOP] = self._seq
            raise


class _Announced:
    __slots__ = ("_engine", "_flags", "_leave", "_point", "_seq")

    def __init__(self, flags: Flags, seq: int, engine: Callable[[], None] | None) -> None:
        self._flags = flags
        self._seq = seq
        self._engine = engine
        self._point = 0
        self._leave: int | None = None

    def __call__(self) -> None:
        point = self._point
        self._point += 1
        if self._engine is None:
            code = self._flags[LEAVE]
            if code >> _SHIFT == self._seq and point >= code & _POINT:
                raise StopRun
            return
        if self._leave is not None:
            if point >= self._leave:
                raise StopRun
            return
        try:
            self._engine()
        except StopRun:
            # The engine's check noted that it asked to leave; we leave one point on.
            self._leave = point + 1
            self._flags[LEAVE] = (self._seq << _SHIFT) | self._leave


class _ByLoad:
    """Both ways of one step; ``split`` says which one the current call uses."""

    __slots__ = ("_announced", "_split", "split")

    def __init__(self, flags: Flags, seq: int, engine: Callable[[], None] | None) -> None:
        self._split = _Split(flags, seq, engine)
        self._announced = _Announced(flags, seq, engine)
        self.split = False

    def __call__(self) -> None:
        if self.split:
            self._split()
        else:
            self._announced()


def choose(split: bool) -> None:
    """Tell this thread's step check which way the next model call goes (by load only)."""
    check = current_check()
    if isinstance(check, _ByLoad):
        check.split = split


def agreed_check(
    agreement: Agreement,
    flags: Flags,
    seq: int,
    *,
    writer: bool,
    engine: Callable[[], None] | None,
) -> Callable[[], None]:
    """The cancel-point check of one step on one rank.

    Args:
        agreement: how the layout agrees.
        flags: the group's flags.
        seq: the step's plan number.
        writer: rank 0 (which writes the flags) rather than another rank.
        engine: rank 0's engine check (``None``: no engine armed this call, so the
            step is never left).
    """
    if writer and engine is None:
        return _never
    kinds: dict[Agreement, Any] = {"split": _Split, "announced": _Announced, "by-load": _ByLoad}
    return kinds[agreement](flags, seq, engine if writer else None)  # type: ignore[no-any-return]


def _never() -> None:
    return None
