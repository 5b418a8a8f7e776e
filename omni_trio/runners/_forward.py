"""One forward of the denoiser as a value the per-row features read: the model call's room.

``DiffusersRunner`` makes one model call per round of a step: the rows of every
request in the round (two each under classifier-free guidance), joined. The per-row
features inside that call (the step cache, L80; adapters, L85) need the same facts:
which rows are whose, which of them a block computes now, what this process runs of
them (a rank of a parallel group runs a slice of the rows, or a slice of every row's
tokens). So the runner describes the call once, as a frozen ``ModelCall``, and sets it
for the call (``calling``); each feature makes its own part of the call from it (a
``CallPart``: its per-call state, committed when the call returns) and reads the
context where it runs, in the blocks and layers, through ``current()``. Features read
the context, never each other: the step cache says which rows compute now
(``Forward.computing``), the adapters read it.

Several ranks: a rank runs the call's rows ``low..high`` alone (``rows_slice``): every
part narrows to them, and the exchanges the parts declare (``Exchange``: what a slice's
updates are as tensors, and how to take the other slices') are handed to the rank,
which runs the collectives; or it runs a slice of every row's tokens
(``token_split``): a decision over a row's tokens reads the group's sums, which the
rank's ``sums`` function adds over the ranks. ``omni_trio.parallel`` calls these and
the ``Exchange`` protocol only: it imports no feature's private names.

One thread-local holds the call under way in each thread (the engine's worker thread
runs the model; several runners in one process run in their own threads).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "CallPart",
    "Exchange",
    "Forward",
    "ModelCall",
    "calling",
    "current",
    "rows_slice",
    "token_split",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCall:
    """One model call of the denoiser: whose its rows are, and where it runs.

    Args:
        states: the requests' states in the call's order (the runner's ``RequestState``).
        rows: how many rows each state has in the call (1, or 2 with guidance).
        device: the device the call's tensors are on.
    """

    states: tuple[Any, ...]
    rows: tuple[int, ...]
    device: torch.device

    @property
    def total(self) -> int:
        """The call's rows in all."""
        return sum(self.rows)

    def owners(self) -> Iterator[tuple[Any, int, int]]:
        """Each state with the first of its rows and their count, in order."""
        start = 0
        for state, count in zip(self.states, self.rows, strict=True):
            yield state, start, count
            start += count


class Exchange(Protocol):
    """What a rank's slice of a call split by rows must send the other ranks, and how it
    takes theirs: every rank's copy of the per-row state then equals one process's."""

    #: Floats per row of ``pack``'s record.
    fields: int

    def pack(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This slice's updates as float32: a ``[rows, fields]`` record (a row beyond the
        slice's is all -1) and one payload, flat."""
        ...

    def merge(
        self, others: Sequence[tuple[int, torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> None:
        """Keep this slice's updates and the other ranks': each ``(low, record, payload)``
        as their ``pack`` made them; ``dtype`` is the model's."""
        ...


class CallPart(Protocol):
    """A feature's part of one model call (its per-call state)."""

    def narrowed(self, low: int, high: int) -> CallPart | None:
        """Its part of the call's rows ``low..high`` (a rank's slice); ``None``: none."""
        ...

    def exchange(self) -> Exchange | None:
        """What its slice (from ``narrowed``) must exchange with the other ranks."""
        ...

    def commit(self) -> None:
        """The call returned: keep what it changed (a failed or left call keeps nothing)."""
        ...


@dataclass(eq=False, slots=True)
class Forward:
    """The model call under way in this thread, as the features find it.

    ``parts`` are the features' parts of it, by name. ``computing`` is set by the step
    cache inside the tail of a forward where some rows skip: the call's rows that the
    block running now computes, in order (the rows its tensors hold); ``None``: every
    row. ``sums`` is set for a call whose tokens are split over ranks (``token_split``).
    """

    call: ModelCall | None
    parts: dict[str, CallPart] = field(default_factory=dict)
    #: The rows this forward covers of the call, when fewer (a rank's slice).
    low: int = 0
    high: int | None = None
    computing: list[int] | None = None
    sums: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def rows(self) -> int | None:
        """How many rows the denoiser's tensors have in this forward (``None``: no call)."""
        if self.call is None:
            return None
        high = self.call.total if self.high is None else self.high
        return high - self.low

    def part(self, name: str) -> Any:
        """The part of feature ``name``, or ``None``."""
        return self.parts.get(name)


_local = threading.local()


def current() -> Forward | None:
    """The model call under way in this thread, or ``None``."""
    forward: Forward | None = getattr(_local, "forward", None)
    return forward


@contextmanager
def calling(call: ModelCall | None, parts: dict[str, CallPart]) -> Iterator[Forward]:
    """Inside, ``call`` is under way in this thread with the features' ``parts``; on a
    normal exit every part commits (an exception commits none).

    ``call`` ``None``: a call outside the denoiser's rounds (a text encoder's, for one
    request), which only the parts describe.
    """
    saved = current()
    forward = Forward(call, parts)
    _local.forward = forward
    try:
        yield forward
    finally:
        _local.forward = saved
    for part in parts.values():
        part.commit()


@contextmanager
def rows_slice(low: int, high: int) -> Iterator[list[Exchange]]:
    """Inside, the call under way runs only its rows ``low..high`` here (a rank's slice of
    a call split by rows); yields the exchanges the features declare for the slice, which
    the caller runs once the slice's forward returned. Outside a call: nothing, no
    exchange."""
    outer = current()
    if outer is None:
        yield []
        return
    parts: dict[str, CallPart] = {}
    for name, part in outer.parts.items():
        narrowed = part.narrowed(low, high)
        if narrowed is not None:
            parts[name] = narrowed
    inner = Forward(outer.call, parts, low=outer.low + low, high=outer.low + high)
    inner.sums = outer.sums
    exchanges = [exchange for part in parts.values() if (exchange := part.exchange()) is not None]
    _local.forward = inner
    try:
        yield exchanges
    finally:
        _local.forward = outer


@contextmanager
def token_split(sums: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Inside, the call under way holds a slice of every row's tokens here: a decision over
    a row's tokens reads the group's sums, ``sums(local)`` (per row, over every rank, the
    same bits on every rank)."""
    forward = current()
    if forward is None:
        yield
        return
    saved, forward.sums = forward.sums, sums
    try:
        yield
    finally:
        forward.sums = saved
