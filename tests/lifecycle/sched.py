"""The model of one worker's step boundaries: what it drops, suspends and takes (L60, L61).

``WorkerModel`` replays, boundary by boundary, what the worker of a one-worker
engine must do, from what the model knows: the requests waiting (new ones, and
suspended ones with the steps they reached), the batch at the gate, the tokens
set, the failure armed. The machine feeds it the batches its ``GatedRunner``
saw, in order: each must be the batch the model predicts, and each request ends
as the model says. It is a pure simulation, written from the contract and the
design rules (``docs/design.md``, "Preemption"), not from the engine's code:

- at a boundary the worker drops every member whose token is set (L7), or all
  of them and everything waiting once shutdown stops it (L32);
- if the best-ranked waiting request (new or suspended) cannot start (the batch
  is full, or has another batch key) and has a strictly higher priority than
  running members suspended fewer than ``max_preemptions`` times, the worker
  suspends the lowest-ranked of them when the newcomer could join, or the whole
  batch when every member qualifies and only an empty batch lets it start; then
  it starts that newcomer alone at this boundary (L61); between tenants of one
  priority (L61 amended, L57), when the newcomer could join the full batch and
  no lower priority may go, a member of another tenant goes instead if, counting
  each tenant's member-steps at that priority over those of the worker's last
  ``RECENT_STEPS`` full steps that ran it and this boundary, that tenant keeps at least as
  many per weight as the newcomer's would hold (the one most over gives up its
  lowest-ranked member); if none does, each other tenant's best-ranked request
  of that priority and key, best-ranked first, may so take a place;
- otherwise it takes the best-ranked waiting requests while they have the
  batch's key and places are free (L60); a suspended one resumes from the step it
  reached, keeping its rank;
- the rank within a priority level is fair share's (L57, docs/design.md,
  "Scheduling"): the tenant with the smallest tag first, then the earliest
  deadline and admission; taking a new request moves its level's virtual time
  to its tenant's tag and the tag on by its cost over the tenant's weight (a
  resumed one is not charged again); a tenant that starts waiting takes the
  later of the virtual time and its tag; a level where nothing waits forgets
  its tags. The model checks the share it implies: while two tenants both wait
  at a level, the step-seconds each was charged since, over its weight, differ
  by at most one request's cost (the most either sent) over its weight; a
  request tenant preemption starts out of this order counts the pair's drift
  anew from then, the gap between the two tags then added to the bound;
- a released step fails the whole batch when a member is about to run the armed
  step (L22), kills the worker when a kill is armed (L23), and otherwise counts a
  step for each member (and, if the batch was full, a step of the window); a
  member whose last step ran completes, unless its token was set by anything but
  shutdown (the materializer checks it before the decode, L10, L21).

A token the engine sees at a moment of the threads' choosing (``Job.loose``: set
while the gate is open, or racing the worker's take) is resolved from what the
runner saw: the member is dropped at the boundary where it leaves the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import omni_trio as ot

__all__ = ["RECENT_STEPS", "Job", "WorkerModel"]

#: How many of the worker's last full batch steps tenant preemption counts (L61).
RECENT_STEPS = 1024

Where = Literal["fresh", "running", "parked", "ended"]
_S = ot.RequestStatus


@dataclass(eq=False)
class Job:
    """One admitted request as the worker model sees it."""

    name: str
    request: ot.GenerationRequest
    # (-priority, deadline epoch or inf, admission): smaller is taken first.
    rank: tuple[int, float, int]
    where: Where = "fresh"
    steps: int = 0
    preemptions: int = 0
    token: str | None = None  # why something asked the engine to end it
    loose: bool = False  # when the engine sees its token depends on the threads
    # Its end, once the model knows it; ``None`` while live, or when any end
    # will do (a loose token, a dead worker).
    end: _S | None = None
    ended_suspended: bool = False  # withdrawn while suspended: released at once, undecoded

    @property
    def key(self) -> Hashable:
        """The batch key of the FakeRunner (height, width, number of images)."""
        return (self.request.height, self.request.width, self.request.num_images)

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def tenant(self) -> str | None:
        return self.request.tenant

    def cost(self, pixel_s: float) -> float:
        """What fair share charges for it, priced at ``pixel_s`` per pixel-step."""
        request = self.request
        pixels = request.num_images * request.height * request.width
        return request.num_steps * (pixel_s * pixels)

    def __repr__(self) -> str:
        cut = "" if self.token is None else f" cut({self.token}{', loose' if self.loose else ''})"
        steps = f"{self.steps}/{self.request.num_steps}"
        return f"<{self.name} p{self.priority} {self.where} {steps}{cut}>"


def _names(jobs: Sequence[Job]) -> list[str]:
    return sorted(job.name for job in jobs)


@dataclass(eq=False)
class WorkerModel:
    """The one worker's batch and queues, advanced one boundary at a time."""

    max_batch: int
    max_preemptions: int
    fresh: list[Job] = field(default_factory=list)
    parked: list[Job] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    # The batch whose step waits at the gate (not yet released), if any.
    pending: list[Job] | None = None
    preemptions: int = 0
    resumes: int = 0
    # Shutdown without a grace period: the next boundary drops everything.
    stopping: bool = False
    dead: bool = False
    exited: bool = False
    # Fair share (L57): the tenants' weights and the price of a pixel-step; per
    # level the virtual time and the tenants' tags; per level and tenant the
    # fair-share cost charged so far over the weight, the most one request of it
    # costs, and the pairs of tenants waiting together since the charges given.
    weights: dict[str, float] = field(default_factory=dict)
    # Whether a tenant over its share of a full batch gives a place up (L61 amended),
    # and the (priority, tenant) of each member of the last full batch steps.
    tenant_preemption: bool = True
    recent: deque[tuple[tuple[int, str | None], ...]] = field(default_factory=deque)
    pixel_s: float = 1.0
    virtual: dict[int, float] = field(default_factory=dict)
    tags: dict[tuple[int, str | None], float] = field(default_factory=dict)
    charged: dict[tuple[int, str | None], float] = field(default_factory=dict)
    largest: dict[tuple[int, str | None], float] = field(default_factory=dict)
    together: dict[tuple[int, str | None, str | None], tuple[float, float, float]] = field(
        default_factory=dict
    )
    # The levels where tenant preemption started a request out of fair share's order
    # since anything last waited there: their pairs' bounds add their tags' gap.
    jumped: set[int] = field(default_factory=set)

    def admit(self, job: Job) -> None:
        assert not self.exited and not self.dead
        self._join(job)
        self.fresh.append(job)

    # -- fair share --

    def _weight(self, tenant: str | None) -> float:
        return 1.0 if tenant is None else self.weights.get(tenant, 1.0)

    def _waits(self, priority: int, tenant: str | None) -> bool:
        return any(
            job.priority == priority and job.tenant == tenant for job in [*self.fresh, *self.parked]
        )

    def _tag(self, priority: int, tenant: str | None) -> float:
        now = self.virtual.setdefault(priority, 0.0)
        return self.tags.setdefault((priority, tenant), now)

    def _join(self, job: Job) -> None:
        """``job`` is about to wait (admitted, or suspended); call before it is listed."""
        level, tenant = job.priority, job.tenant
        place = (level, tenant)
        self.largest[place] = max(self.largest.get(place, 0.0), job.cost(self.pixel_s))
        if self._waits(level, tenant):
            return
        now = self.virtual.setdefault(level, 0.0)
        self.tags[place] = max(now, self.tags.get(place, now))
        for other in {j.tenant for j in [*self.fresh, *self.parked] if j.priority == level}:
            self._pair_from_now((level, tenant, other))

    def _pair_from_now(self, pair: tuple[int, str | None, str | None]) -> None:
        """Count the pair's drift from now (L57)."""
        level, first, second = pair
        gap = 0.0
        if level in self.jumped:
            gap = abs(self._tag(level, first) - self._tag(level, second))
        self.together[pair] = (
            self.charged.get((level, first), 0.0),
            self.charged.get((level, second), 0.0),
            gap,
        )

    def _left(self, job: Job, *, charge: bool, jumped: bool = False) -> None:
        """``job`` stopped waiting (taken, when ``charge``, or ended); it is unlisted.

        ``jumped``: tenant preemption took it out of fair share's order.
        """
        level, tenant = job.priority, job.tenant
        place = (level, tenant)
        if charge:
            start = self._tag(level, tenant)
            self.virtual[level] = max(self.virtual[level], start)
            share = job.cost(self.pixel_s) / self._weight(tenant)
            self.tags[place] = start + share
            self.charged[place] = self.charged.get(place, 0.0) + share
            if jumped:
                self.jumped.add(level)
                for pair in [p for p in self.together if p[0] == level and tenant in p[1:]]:
                    self._pair_from_now(pair)
            self._check_share(level)
        if not self._waits(level, tenant):
            self.together = {
                pair: base
                for pair, base in self.together.items()
                if not (pair[0] == level and tenant in pair[1:])
            }
        if not any(j.priority == level for j in [*self.fresh, *self.parked]):
            self.jumped.discard(level)
            self.virtual.pop(level, None)
            self.tags = {place: tag for place, tag in self.tags.items() if place[0] != level}

    def _check_share(self, level: int) -> None:
        """L57: no tenant's charged share drifts from another's beyond one request's cost."""
        for (at, first, second), (base_first, base_second, gap) in self.together.items():
            if at != level:
                continue
            drift = (self.charged.get((at, first), 0.0) - base_first) - (
                self.charged.get((at, second), 0.0) - base_second
            )
            bound = self.largest[at, first] / self._weight(first)
            bound += self.largest[at, second] / self._weight(second) + gap
            assert abs(drift) <= bound + 1e-9, (
                f"L57: tenants {first!r} and {second!r} waited together at priority {at}"
                f" and their charged step-seconds over their weights drifted {drift:g} apart"
                f" (bound {bound:g})"
            )

    def cancel(self, job: Job, reason: str, *, taken: bool) -> None:
        """Its token was set (before the next released step; ``taken``: the runner had it).

        A new request waiting is withdrawn at once (L6), unless a loose token
        lost the race with the worker's take; a suspended one is released at
        once, never decoded (L61); a running one is dropped at the next boundary.
        """
        job.token = reason
        if job.where == "fresh" and not (job.loose and taken):
            self._end(job, _S.ABORTED)
        elif job.where == "parked":
            job.ended_suspended = True
            self._end(job, _S.ABORTED)

    def sync(
        self,
        batches: Sequence[list[Job]],
        *,
        at_gate: bool,
        fail_at: int | None,
        kill: bool,
    ) -> None:
        """Replay the steps the runner saw since the last call; check each batch.

        ``at_gate``: the last batch waits at the gate now; otherwise the worker
        idles (or exited) and every batch seen was released. ``fail_at`` and
        ``kill`` are what was armed when those steps were released (nothing
        changes them while steps are released).

        Raises:
            AssertionError: the worker ran a batch the model does not predict.
        """
        for index, batch in enumerate(batches):
            assert not self.dead and not self.exited, f"a step ran after the worker ended: {batch}"
            if self.pending is not None:
                self._run(fail_at=fail_at, kill=kill)
                assert not self.dead and not self.exited, f"a step ran after the end: {batch}"
            else:
                assert index == 0, "the worker went idle between two steps"
            self.boundary(batch)
            assert set(self.running) == set(batch), (
                f"L60, L61: the worker ran {_names(batch)}, the model predicts"
                f" {_names(self.running)} (waiting: {self.fresh}, suspended: {self.parked})"
            )
            self.pending = list(self.running)
        if at_gate:
            assert self.pending is not None, "a step waits at the gate, the model has none"
            return
        if self.pending is not None:
            self._run(fail_at=fail_at, kill=kill)
        if not self.dead and not self.exited:
            self.boundary(None)
            assert not self.running, (
                f"L60: the worker idles, the model predicts it runs {_names(self.running)}"
            )

    # -- one boundary, one step --

    def _rank(self, job: Job) -> tuple[int, float, float, int]:
        """Fair share's rank: (-priority, its tenant's tag, deadline, admission)."""
        rank = job.rank
        return (rank[0], self._tag(job.priority, job.tenant), rank[1], rank[2])

    def _best(self) -> Job | None:
        waiting = [*self.fresh, *self.parked]
        return min(waiting, key=self._rank) if waiting else None

    def _end(self, job: Job, status: _S | None) -> None:
        waited = job in self.fresh or job in self.parked
        for jobs in (self.fresh, self.parked, self.running):
            if job in jobs:
                jobs.remove(job)
        if waited:
            self._left(job, charge=False)
        job.where = "ended"
        job.end = None if (job.loose and job.token is not None) or self.dead else status

    def _start(self, job: Job, *, jumped: bool = False) -> None:
        resumed = job in self.parked
        if resumed:
            self.parked.remove(job)
            self.resumes += 1
        else:
            self.fresh.remove(job)
        # A resumed request was charged when it was first taken.
        self._left(job, charge=not resumed, jumped=jumped)
        job.where = "running"
        self.running.append(job)

    def boundary(self, observed: Sequence[Job] | None = None) -> None:
        """Advance one step boundary: drop, stop, suspend or take (see the module's rules).

        ``observed``: the batch the runner ran next, which resolves loose tokens;
        ``None`` when none ran. ``tests/test_scheduler.py`` checks the engine's
        boundary policy (``_scheduler.plan_boundary``) against this, one boundary
        at a time, with no engine.
        """
        for job in list(self.running):
            # A loose token: seen at the boundary where the job leaves the batch.
            if job.token is not None and (not job.loose or observed is None or job not in observed):
                self._end(job, _S.ABORTED)
        if self.stopping:
            for job in [*self.running, *self.parked, *self.fresh]:
                job.ended_suspended = job.where == "parked"
                self._end(job, _S.ABORTED)
            self.exited = True
            return
        best = self._best()
        if best is None:
            return
        if self.running and self._preempt(best):
            return
        free = self.max_batch - len(self.running)
        key = self.running[0].key if self.running else None
        while free > 0:
            best = self._best()
            if best is None:
                break
            if key is None:
                key = best.key
            elif best.key != key:
                break
            self._start(best)
            free -= 1

    def _preempt(self, newcomer: Job) -> bool:
        """Suspend members for ``newcomer`` if L61 says so, and start it; return whether."""
        joinable = newcomer.key == self.running[0].key
        if joinable and len(self.running) < self.max_batch:
            return False
        eligible = [
            job
            for job in self.running
            if job.priority < newcomer.priority and job.preemptions < self.max_preemptions
        ]
        jumped = False
        if joinable:
            victims = [max(eligible, key=lambda job: job.rank)] if eligible else []
            if not victims and self.tenant_preemption:
                victims = self._over_share(newcomer)
                for head in [] if victims else self._heads(newcomer):
                    victims = self._over_share(head)
                    if victims:
                        newcomer, jumped = head, True
                        break
        else:
            victims = eligible if len(eligible) == len(self.running) else []
        if not victims:
            return False
        # The engine reserves the newcomer first, then parks the victims.
        self._start(newcomer, jumped=jumped)
        for job in victims:
            self.running.remove(job)
            job.where = "parked"
            job.preemptions += 1
            self.preemptions += 1
            self._join(job)
            self.parked.append(job)
        return True

    def _heads(self, best: Job) -> list[Job]:
        """Each other tenant's best-ranked waiting request at ``best``'s priority, best
        first, of those with ``best``'s batch key."""
        heads: dict[str | None, Job] = {}
        for job in sorted([*self.fresh, *self.parked], key=self._rank):
            if job.priority == best.priority and job.tenant != best.tenant:
                heads.setdefault(job.tenant, job)
        return [job for job in heads.values() if job.key == best.key]

    def _over_share(self, newcomer: Job) -> list[Job]:
        """L61 amended (L57): the member of another tenant a full batch gives up, if any.

        At the newcomer's priority, a tenant's count is its places now plus its
        member-steps there in the window; ``steps`` is this boundary plus the
        window's steps that ran that priority. A tenant gives up a place when, one
        place-step fewer per step, it keeps at least as many per weight as the
        newcomer's tenant would with one more; of those the one with the most per
        weight gives up its lowest-ranked member that may still be suspended (ties:
        the lowest-ranked member).
        """
        level = [job for job in self.running if job.priority == newcomer.priority]
        steps = 1 + sum(any(ran[0] == newcomer.priority for ran in step) for step in self.recent)

        def count(tenant: str | None) -> int:
            held = sum(job.tenant == tenant for job in level)
            ran = (newcomer.priority, tenant)
            return held + sum(step.count(ran) for step in self.recent)

        would = (count(newcomer.tenant) + steps) / self._weight(newcomer.tenant)
        choices = []
        for tenant in {job.tenant for job in level} - {newcomer.tenant}:
            share = count(tenant) / self._weight(tenant)
            movable = [
                job
                for job in level
                if job.tenant == tenant and job.preemptions < self.max_preemptions
            ]
            if (count(tenant) - steps) / self._weight(tenant) >= would and movable:
                last = max(movable, key=lambda job: job.rank)
                choices.append((share, last.rank, last))
        return [max(choices, key=lambda choice: choice[:2])[2]] if choices else []

    def _run(self, *, fail_at: int | None, kill: bool) -> None:
        """The pending batch's step was released."""
        batch, self.pending = self.pending, None
        assert batch is not None
        if fail_at is not None and any(job.steps + 1 == fail_at for job in batch):
            for job in batch:
                self._end(job, _S.FAILED)  # L22: the whole batch, a token or not
            return
        for job in batch:
            job.steps += 1
        if len(batch) == self.max_batch:
            self.recent.append(tuple((job.priority, job.tenant) for job in batch))
            if len(self.recent) > RECENT_STEPS:
                self.recent.popleft()
        if kill:
            self.dead = True
            for job in [*self.running, *self.parked, *self.fresh]:
                self._end(job, None)
            return
        for job in batch:
            if job.steps == job.request.num_steps:
                # The materializer checks the token before the decode (L10, L21);
                # shutdown's lets finished denoising be delivered.
                cut = job.token is not None and job.token != "shutdown"
                self._end(job, _S.ABORTED if cut else _S.COMPLETED)
