"""What rank 0 tells the other ranks: one plan per step boundary, in order (L40).

Rank 0 (the engine's process) is the only rank that knows the engine: which
requests run, join, leave, are suspended or resumed, and when the group stops.
It tells every other rank in plans, each one message on that rank's control pipe,
read in order:

- ``STEP``: the step's members, by key, in the batch's order, after the ops that
  precede it; every rank then runs exactly that step, so every rank makes the
  same model calls and so the same collectives, in the same order. No rank
  decides anything for itself: none can skip or add a collective.
- ``OPS``: ops only (a join, sent as soon as rank 0 prepares it, so that every
  rank prepares it at the same time).
- ``REPORT``: ops, then answer with what this rank holds (``RankReport``).
- ``ADAPTERS``: ops (an adapter's load, an update of the weights, a sleep, a wake:
  L102, L103), then answer with those that failed on this rank: rank 0 goes first,
  and undoes its own when another rank's fails.
- ``STOP``: the group closes.

An op names a request by its *key*, a number rank 0 gives each admission once
(never its id: ids are reused, L3). A join carries the request itself, its seed
fixed by rank 0, so that every rank prepares the same state. An adapter's load and
unload are ops too, in the same order as the joins and drops around them: every
rank's adapters see the same loads, holds and releases in the same order, and so
evict the same ones (L87).

Plans travel on pipes, not through a collective: a rank waits for its next plan
as long as the engine is idle (a collective would time out), a dead peer is seen
at once (the pipe breaks), and on a GPU the plan costs no device work.
"""

from __future__ import annotations

import enum
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._adapters import AdapterInfo

__all__ = [
    "Op",
    "OpKind",
    "Plan",
    "PlanKind",
    "RankReport",
    "decode_plan",
    "encode_plan",
    "picklable_source",
]


class OpKind(enum.IntEnum):
    """What an op does to one request's state on every rank."""

    JOIN = 1
    DROP = 2
    SUSPEND = 3
    RESUME = 4
    LOAD_ADAPTER = 5
    UNLOAD_ADAPTER = 6
    CACHE_THRESHOLD = 7
    UPDATE_WEIGHTS = 8
    COMMIT_WEIGHTS = 9
    REVERT_WEIGHTS = 10
    SLEEP_WEIGHTS = 11
    WAKE_WEIGHTS = 12


class PlanKind(enum.IntEnum):
    """What a plan asks of the ranks, after its ops."""

    STEP = 1
    OPS = 2
    REPORT = 3
    STOP = 4
    ADAPTERS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One change to the group's states: ``kind`` of the request with ``key``.

    A join carries the request's record (``_codec.request_record``, images as
    tensors) and its id; a
    suspension whether it parks in host memory; an adapter's load its ``name`` and
    ``source`` (an absolute file path or a state dict), its unload its ``name``
    (``key`` 0: no request); a step cache's loosened ``threshold`` (L84); an update
    of the weights its ``source`` and, in ``name``, its key (L102); a sleep its level
    in ``key`` (L103).
    """

    kind: OpKind
    key: int
    request: Mapping[str, Any] | None = None
    request_id: str = ""
    to_host: bool = False
    name: str = ""
    source: Any = None
    threshold: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """One message from rank 0: ops, then ``kind``.

    Args:
        seq: the plan's number (1, 2, ...); the agreed cancel points of a step
            are keyed by it.
        kind: what to do after the ops.
        ops: the changes, in the order rank 0 made them.
        members: a step's states by key, in the batch's order.
        threads: rank 0's torch thread count: every rank computes with it, so
            reductions add in the same order and the ranks' states stay equal.
        sent_at: ``time.perf_counter()`` when rank 0 sent it (the clock is the
            machine's, the same in every process), for the delivery figure.
    """

    seq: int
    kind: PlanKind
    ops: tuple[Op, ...] = ()
    members: tuple[int, ...] = ()
    threads: int = 1
    sent_at: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """What one rank holds, as a ``REPORT`` plan found it.

    Args:
        rank: the rank.
        states: every request state the rank holds: its id -> a digest of its
            latents and position (equal digests: bitwise equal states).
        plan_delivery_s: how long each plan took from rank 0's send to this
            rank's read, oldest first (the last 10,000; empty for rank 0).
        calls: the model calls this rank made each way since it started:
            ``"rows"`` (each rank a slice of the rows) and ``"tokens"`` (sequence
            parallel); every rank of a sound group counts the same.
        adapters: the adapters the rank knows (``DiffusersRunner.adapters()``):
            loaded or evicted, their holders; the same on every rank of a sound group.
    """

    rank: int
    states: Mapping[str, str]
    plan_delivery_s: tuple[float, ...] = ()
    calls: Mapping[str, int] = field(default_factory=dict)
    adapters: tuple[AdapterInfo, ...] = ()


def encode_plan(plan: Plan) -> bytes:
    """The plan as bytes for a control pipe (the ranks trust each other: pickle)."""
    return pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)


def decode_plan(data: bytes) -> Plan:
    """The plan ``encode_plan`` made."""
    plan = pickle.loads(data)
    assert isinstance(plan, Plan)
    return plan


def picklable_source(source: Any) -> Any:
    """A load's or an update's source as an op carries it to the ranks: a file by its
    absolute path, a mapping as a plain dict (which pickles)."""
    if isinstance(source, str | os.PathLike):
        return os.path.abspath(source)
    if isinstance(source, Mapping):
        return dict(source)
    return source
