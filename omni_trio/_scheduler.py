"""The boundary policy: what a worker does at a step boundary; pure, synchronous.

No I/O, no threads, no locks: the worker calls ``plan_boundary`` under its pool's
lock and applies what it returns (see ``_worker``). The queue it takes from, its
ranking and batch formation are ``_queue``'s.

At every step boundary a worker hands over
what it runs (``Member``: each member's batch key, rank, suspensions and whether
its token is set), its queues and the pool's facts (stopping, idle workers), and
gets back a ``BoundaryPlan``: what leaves the batch, what joins it, which members
to suspend for which newcomer (L61), whether to stop, whether to wait. The rules:

- a member whose token is set leaves the batch (L7, L21); once the pool stops,
  every member leaves, and every waiting request with them (L32);
- where to take from (L42): the worker's own suspended requests always; new ones
  too, unless it is busy while another worker idles (the idle one starts them
  alone, on its own device);
- preemption (L61), with a suspendable runner: when the best-ranked request the
  worker could take has a strictly higher priority than running members
  suspended fewer than ``max_preemptions`` times and cannot start otherwise (the
  batch is full, has another batch key, or takes no joins), the victims are the
  lowest-ranked qualifying member when the newcomer could join, or the whole
  batch when only an empty batch lets it start and every member qualifies;
- otherwise it takes (``take``) what may enter the batch; an idle worker that
  wakes beside other idle ones takes only its share of the waiting requests (their
  number over the idle workers, rounded up), not a batch that leaves them idle;
- with nothing to run, drop or take, it waits.

It costs O(b) for a batch of b members plus ``take``'s O(log n) per request taken:
never a scan of a queue.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ._queue import Rank, WaitingQueue, best_of, take

__all__ = [
    "BoundaryPlan",
    "BoundaryRules",
    "Member",
    "Preemption",
    "plan_boundary",
    "plan_preemption",
    "sources",
]

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True, slots=True, kw_only=True)
class Member(Generic[T]):
    """One running batch member, as the boundary policy sees it."""

    item: T
    #: Its batch key.
    key: Hashable
    #: Its rank, as the queue compares them (the smallest is the best-ranked).
    rank: Rank
    #: How often it was suspended (L61).
    preemptions: int
    #: Whether its token is set: it leaves the batch at this boundary.
    stopped: bool

    @property
    def priority(self) -> int:
        """Its priority (higher first)."""
        return -self.rank[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryRules:
    """What a worker's boundaries obey, fixed for its life."""

    #: The most members one step runs (the engine's and the runner's limit).
    max_batch: int
    #: Whether requests may join a running batch.
    can_join: bool
    #: Whether running members may be suspended for better-ranked ones (L61).
    preempting: bool
    #: How often one request may be suspended at most.
    max_preemptions: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Preemption(Generic[T]):
    """Suspend ``victims`` so that ``newcomer`` starts at this boundary (L61)."""

    victims: tuple[T, ...]
    newcomer: T


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundaryPlan(Generic[T]):
    """What a worker does at one step boundary; see ``plan_boundary``."""

    #: The members that stay in the batch, in their order.
    keep: tuple[T, ...] = ()
    #: What leaves without running on: members whose token is set; once stopping,
    #: every member and every waiting request too.
    drop: tuple[T, ...] = ()
    #: Taken out of the queues to join the batch, best-ranked first.
    admit: tuple[T, ...] = ()
    #: Suspend these members for a newcomer (nothing is admitted then).
    preempt: Preemption[T] | None = None
    #: The pool stops: drop everything and exit.
    stop: bool = False

    @property
    def wait(self) -> bool:
        """Whether there is nothing to run, drop or take: wait for news."""
        return not (self.keep or self.drop or self.admit or self.preempt or self.stop)


def sources(
    fresh: WaitingQueue[T], parked: WaitingQueue[T], *, busy: bool, idle: int
) -> tuple[WaitingQueue[T], ...]:
    """Where a worker may take from now (L42).

    Its own suspended requests (``parked``) always; new ones (``fresh``) too,
    unless it is ``busy`` while ``idle`` other workers wait (they start them alone,
    on their own devices).
    """
    return (parked,) if busy and idle else (fresh, parked)


def plan_preemption(
    members: Sequence[Member[T]], queues: Sequence[WaitingQueue[T]], rules: BoundaryRules
) -> Preemption[T] | None:
    """The members to suspend so that the best-ranked waiting request starts (L61).

    Only members of strictly lower priority that were suspended fewer than
    ``max_preemptions`` times qualify. When the newcomer could join the batch but
    it is full, the lowest-ranked qualifying member makes room; when only an empty
    batch lets it start (another batch key, or a runner that takes no joins),
    every member must qualify, or none is suspended. Reads the queues, changes
    nothing; ``None`` when nobody is suspended.
    """
    best = best_of(queues) if members else None
    if best is None:
        return None
    newcomer, key, priority, _ = best
    joinable = rules.can_join and key == members[0].key
    if joinable and len(members) < rules.max_batch:
        return None  # it joins at this boundary anyway
    eligible = [
        member
        for member in members
        if member.priority < priority and member.preemptions < rules.max_preemptions
    ]
    if not eligible:
        return None
    if joinable:
        victim = max(eligible, key=lambda member: member.rank)
        return Preemption(victims=(victim.item,), newcomer=newcomer)
    if len(eligible) < len(members):
        return None
    return Preemption(victims=tuple(member.item for member in eligible), newcomer=newcomer)


def plan_boundary(
    members: Sequence[Member[T]],
    *,
    fresh: WaitingQueue[T],
    parked: WaitingQueue[T],
    rules: BoundaryRules,
    stopping: bool,
    idle: int,
) -> BoundaryPlan[T]:
    """Decide one step boundary of a worker (see the module's docstring for the rules).

    Args:
        members: the running batch, in its order.
        fresh: the pool's queue of new requests.
        parked: this worker's queue of suspended requests.
        rules: the worker's limits.
        stopping: whether the pool stops.
        idle: how many other workers wait for work.

    Returns:
        The plan. What it admits, and on a stop what it drops of the queues, it
        has taken out of the queues; nothing else changes.
    """
    if stopping:
        # The members whose token is set first, as at any boundary, then the rest.
        stopped = [member.item for member in members if member.stopped]
        rest = [member.item for member in members if not member.stopped]
        return BoundaryPlan(drop=(*stopped, *rest, *parked.drain(), *fresh.drain()), stop=True)
    staying = [member for member in members if not member.stopped]
    keep = tuple(member.item for member in staying)
    drop = tuple(member.item for member in members if member.stopped)
    queues = sources(fresh, parked, busy=bool(staying), idle=idle)
    if rules.preempting:
        preemption = plan_preemption(staying, queues, rules)
        if preemption is not None:
            return BoundaryPlan(keep=keep, drop=drop, preempt=preemption)
    free = rules.max_batch - len(staying)
    if not staying and idle:
        # Share the waiting requests with the idle workers (L42).
        waiting = sum(len(queue) for queue in queues)
        free = min(free, -(-waiting // (idle + 1)))
    admit = take(
        queues,
        batch_key=staying[0].key if staying else None,
        free=free,
        can_join=rules.can_join,
    )
    return BoundaryPlan(keep=keep, drop=drop, admit=tuple(admit))
