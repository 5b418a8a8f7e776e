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
  batch when only an empty batch lets it start and every member qualifies; with
  tenants (L61 amended, L57), a newcomer that could join a full batch where no
  member ranks lower may take the place of a member of its own priority whose
  tenant holds more places than its weight's share (``fair_victim``);
- otherwise it takes (``take``) what may enter the batch; an idle worker that
  wakes beside other idle ones takes only its share of the waiting requests (their
  number over the idle workers, rounded up), not a batch that leaves them idle;
- with nothing to run, drop or take, it waits.

It costs O(b) for a batch of b members plus ``take``'s O(log n) per request taken:
never a scan of a queue.

Admission's estimate (L62) asks the same rule of a worker's published batch
(``RunningBatch.steps_before``, through ``make_room``): whether a newcomer could
start in it at the next boundary, and if not, how many steps it waits.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ._fairshare import Tenant
from ._queue import Rank, WaitingQueue, best_of, take, tenant_heads
from ._steptimes import ShapeTime

__all__ = [
    "RECENT_STEPS",
    "BoundaryPlan",
    "BoundaryRules",
    "Member",
    "Preemption",
    "Recent",
    "RecentSteps",
    "RunningBatch",
    "fair_victim",
    "make_room",
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
    #: Its tenant (L57).
    tenant: Tenant = None

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
    #: Whether, at one priority, a tenant's request may suspend a member of a tenant
    #: that holds more than its share of the batch (L61 amended, L57).
    tenant_preemption: bool = False
    #: The tenants' weights; a tenant not named (and the default one) weighs 1.
    weights: Mapping[str, float] = field(default_factory=dict)

    def weight(self, tenant: Tenant) -> float:
        """The tenant's weight, as fair share has it."""
        return 1.0 if tenant is None else self.weights.get(tenant, 1.0)


#: How many of a worker's last full batch steps tenant preemption looks back on
#: (L61 amended): beside a flood at 2x load ``python -m benchmarks fairness``
#: measured the light tenant's p99 at 1.88x its p99 alone with 64, 1.52x with 256
#: and 1.42x with 1,024 (2.07x with fair share in the queue only).
RECENT_STEPS = 1024


@dataclass(frozen=True, slots=True)
class Recent:
    """A worker's last full batch steps (at most ``RECENT_STEPS``), as tenant
    preemption reads them: at each priority, how many of them ran a member of it,
    and how many member-steps each tenant ran at it.
    """

    levels: Mapping[int, int] = field(default_factory=dict)
    held: Mapping[tuple[int, Tenant], int] = field(default_factory=dict)

    def steps(self, priority: int) -> int:
        """How many of these steps ran a member of ``priority``."""
        return self.levels.get(priority, 0)

    def places(self, priority: int, tenant: Tenant) -> int:
        """The member-steps ``tenant`` ran at ``priority`` in these steps."""
        return self.held.get((priority, tenant), 0)


#: No steps yet: tenant preemption reads the batch's places alone.
NO_STEPS = Recent()


class RecentSteps:
    """The window of a worker's last ``RECENT_STEPS`` full batch steps; one thread's.

    ``ran`` counts a batch step that ran to its end, with its members' priorities
    and tenants, if it was full (``max_batch`` members: only a full batch makes a
    newcomer take a place); ``view`` is an immutable copy for the boundary policy.
    A priority's averages count only the steps that ran it, so a burst of another
    priority does not dilute them.
    """

    def __init__(self, max_batch: int, size: int = RECENT_STEPS) -> None:
        self._steps: deque[tuple[tuple[int, Tenant], ...]] = deque()
        self._held: Counter[tuple[int, Tenant]] = Counter()
        self._levels: Counter[int] = Counter()
        self._max_batch = max_batch
        self._size = size
        self._view = NO_STEPS

    def ran(self, members: Sequence[tuple[int, Tenant]]) -> None:
        if len(members) < self._max_batch:
            return
        step = tuple(members)
        self._steps.append(step)
        self._held.update(step)
        self._levels.update({priority for priority, _ in step})
        if len(self._steps) > self._size:
            gone = self._steps.popleft()
            self._held.subtract(gone)
            self._levels.subtract({priority for priority, _ in gone})
        self._view = Recent(
            {level: n for level, n in self._levels.items() if n},
            {place: n for place, n in self._held.items() if n},
        )

    def view(self) -> Recent:
        return self._view


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


def make_room(
    members: Sequence[Member[T]],
    *,
    key: Hashable,
    priority: int,
    tenant: Tenant = None,
    rules: BoundaryRules,
    recent: Recent = NO_STEPS,
) -> tuple[T, ...] | None:
    """What a newcomer with batch ``key``, ``priority`` and ``tenant`` needs to start in
    this batch now.

    ``()`` when nothing: the batch is empty, or the newcomer may join it as it is
    (its key, a free place, a runner that takes joins). Else, with preemption on
    (L61), the members to suspend: only members of strictly lower priority that
    were suspended fewer than ``max_preemptions`` times qualify; when the newcomer
    could join the batch but it is full, the lowest-ranked qualifying member makes
    room; when only an empty batch lets it start (another batch key, or a runner
    that takes no joins), every member must qualify. When no member of lower
    priority qualifies and the newcomer could join, with ``tenant_preemption`` a
    member of its own priority and another tenant may make room (``fair_victim``).
    ``None`` when it cannot start at this boundary. The one rule both the boundary
    policy (``plan_preemption``) and admission's estimate
    (``RunningBatch.steps_before``) apply.
    """
    if not members:
        return ()
    joinable = rules.can_join and key == members[0].key
    if joinable and len(members) < rules.max_batch:
        return ()
    if not rules.preempting:
        return None
    eligible = [
        member
        for member in members
        if member.priority < priority and member.preemptions < rules.max_preemptions
    ]
    if joinable:
        if eligible:
            return (max(eligible, key=lambda member: member.rank).item,)
        victim = fair_victim(members, priority=priority, tenant=tenant, rules=rules, recent=recent)
        return None if victim is None else (victim,)
    if not eligible or len(eligible) < len(members):
        return None
    return tuple(member.item for member in eligible)


def fair_victim(
    members: Sequence[Member[T]],
    *,
    priority: int,
    tenant: Tenant,
    rules: BoundaryRules,
    recent: Recent = NO_STEPS,
) -> T | None:
    """The member a full batch gives up, at one priority, for another tenant's newcomer.

    L61 amended (L57): at the newcomer's ``priority``, each tenant's places are
    averaged over the worker's recent full steps that ran that priority
    (``Recent``) and this boundary: ``A(x) = (its member-steps in them + the places
    it holds now) / (their number + 1)``; with none yet, the places it holds. A
    tenant ``v`` gives one up to the newcomer's tenant ``t`` when, after the move,
    ``v`` still holds at least as many places per weight as ``t`` would:
    ``(A(v) - 1) / w(v) >= (A(t) + 1) / w(t)``.
    The reverse move at the same boundary would need ``A(t) / w(t) >= A(v) / w(v)``,
    which that condition rules out, so no two tenants take a place back and forth:
    one takes it back only once the window's averages have moved by two places per
    weight, and ``max_preemptions`` bounds every request's suspensions. A tenant
    that has run little lately (a light one beside a flood) may so take more places
    than its weight's share of the batch for a while, up to its share of the window.
    The tenant most over gives up its lowest-ranked member suspended fewer than
    ``max_preemptions`` times; between tenants equally over, the one whose member
    ranks lowest. ``None`` without ``tenant_preemption``, or when no tenant is over.
    """
    if not rules.tenant_preemption:
        return None
    held: dict[Tenant, list[Member[T]]] = {}
    for member in members:
        if member.priority == priority:
            held.setdefault(member.tenant, []).append(member)
    steps = recent.steps(priority) + 1

    def count(owner: Tenant) -> int:
        """``owner``'s member-steps in the window and this boundary: its average
        places times ``steps``."""
        return len(held.get(owner, ())) + recent.places(priority, owner)

    # (A(v) - 1) / w(v) >= (A(t) + 1) / w(t), times ``steps`` and both weights
    # (exact for integer and binary-fraction weights).
    wanted = count(tenant) + steps
    best: tuple[float, Rank, T] | None = None
    for other, group in held.items():
        if other == tenant:
            continue
        if (count(other) - steps) * rules.weight(tenant) < wanted * rules.weight(other):
            continue
        movable = [member for member in group if member.preemptions < rules.max_preemptions]
        if not movable:
            continue
        last = max(movable, key=lambda member: member.rank)
        share = count(other) / rules.weight(other)
        if best is None or (share, last.rank) > best[:2]:
            best = (share, last.rank, last.item)
    return None if best is None else best[2]


def plan_preemption(
    members: Sequence[Member[T]],
    queues: Sequence[WaitingQueue[T]],
    rules: BoundaryRules,
    recent: Recent = NO_STEPS,
) -> Preemption[T] | None:
    """The members to suspend so that the best-ranked waiting request starts (L61).

    The victims are ``make_room``'s for that request. When it could join but the
    batch is full and nobody makes room for it, with ``tenant_preemption`` each other
    tenant's best-ranked request of its priority and batch key, best-ranked first,
    may take a place ``fair_victim`` gives its tenant (L61 amended): a tenant that
    ran little lately starts beside a flood at the next boundary even where fair
    share ranks the flood's next request first. Reads the queues (O(t log t) for
    the t tenants waiting at that priority, only at a full batch's boundary),
    changes nothing; ``None`` when nobody is suspended (it joins at this boundary
    anyway, or it cannot start).
    """
    best = best_of(queues) if members else None
    if best is None:
        return None
    newcomer, key, priority, tenant, _ = best
    victims = make_room(
        members, key=key, priority=priority, tenant=tenant, rules=rules, recent=recent
    )
    if victims:
        return Preemption(victims=victims, newcomer=newcomer)
    blocked = victims is None and rules.preempting and rules.can_join
    if not (blocked and rules.tenant_preemption and key == members[0].key):
        return None
    # The batch is full and the best-ranked request may not take a place: another
    # tenant's best request of its priority and key may (L61 amended).
    for item, head_key, owner in tenant_heads(queues, priority):
        if owner == tenant or head_key != key:
            continue
        victim = fair_victim(members, priority=priority, tenant=owner, rules=rules, recent=recent)
        if victim is not None:
            return Preemption(victims=(victim,), newcomer=item)
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunningBatch:
    """A worker's running batch as admission and statistics read it: one immutable view.

    The worker publishes a new one whenever its batch changes (a boundary that
    drops, admits or suspends; a step), by swapping one reference: a reader in
    another thread sees one boundary's figures, never half of an update (L62).
    """

    #: The members, as the boundary policy sees them; their items are request ids.
    members: tuple[Member[str], ...] = ()
    #: Each member's steps done and steps in all, in the members' order.
    steps: tuple[tuple[int, int], ...] = ()
    #: The worker's measured step time (a moving average); ``None`` before its first.
    step_s: float | None = None
    #: What its warm steps took, by shape (``_steptimes``: admission's step-time
    #: bound, L4); empty before a shape's warm steps.
    shapes: tuple[ShapeTime, ...] = ()
    #: The worker's last batch steps, as tenant preemption reads them.
    recent: Recent = NO_STEPS

    @property
    def steps_left(self) -> int:
        """The steps until the batch is empty: its longest member's steps left."""
        return max((total - done for done, total in self.steps), default=0)

    def steps_before(
        self, *, key: Hashable, priority: int, tenant: Tenant = None, rules: BoundaryRules
    ) -> int:
        """The steps this batch runs before a newcomer could start in it (L62).

        0 when it could start at the next boundary (``make_room``: an empty
        batch, a place to join, or members it preempts); else the batch's steps
        left (its longest member's). A full batch of the newcomer's key frees a
        place sooner, when its first member ends, but that figure made admission
        take requests on the edge of their deadline which the decode and the
        steps' jitter then pushed past it (``python -m benchmarks deadline``: 63
        deadline aborts of 900 against 4), so the longer wait stays as a margin.
        """
        room = make_room(
            self.members,
            key=key,
            priority=priority,
            tenant=tenant,
            rules=rules,
            recent=self.recent,
        )
        if room is not None:
            return 0
        return self.steps_left


def plan_boundary(
    members: Sequence[Member[T]],
    *,
    fresh: WaitingQueue[T],
    parked: WaitingQueue[T],
    rules: BoundaryRules,
    stopping: bool,
    idle: int,
    recent: Recent = NO_STEPS,
) -> BoundaryPlan[T]:
    """Decide one step boundary of a worker (see the module's docstring for the rules).

    Args:
        members: the running batch, in its order.
        fresh: the pool's queue of new requests.
        parked: this worker's queue of suspended requests.
        rules: the worker's limits.
        stopping: whether the pool stops.
        idle: how many other workers wait for work.
        recent: the worker's last batch steps, for tenant preemption.

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
        preemption = plan_preemption(staying, queues, rules, recent)
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
