"""The step loop: one owned, non-daemon thread per device.

At every step boundary, under the pool's lock (microseconds, never across runner
work), the worker asks the boundary policy (``_scheduler.plan_boundary``, a pure
function) for a plan and applies it: it drops the members whose token is set (L7,
L21), takes the requests that may join the batch, or stops. Then, without the
lock, it prepares the new members, runs one runner step for the whole batch and
posts one step event per member. Members whose last step is done go to the
materializer, so the next step starts at once (L16). A whole-call runner (one that
must run its own loop) gets one request at a time, and its step callback is the
boundary (``_wholecall``). The worker never waits for the event loop or a consumer
(L20): it only posts messages.

Cancel points (L71), with a runner that declares ``cancel_points``: the step runs
armed with a check that the runner's ``cancel_point()`` calls between its
transformer blocks (see ``_cancelpoint``). When every
member's token is set (an abort, a gone consumer, a deadline, shutdown past its
grace: the loop sets the token for each), it raises ``StopRun``; the worker then
releases every member undecoded, as a boundary drop does, and counts no step.
When only some members stopped, the step runs on and they drop at its end.

Checkpoints (L78), with a runner that declares ``checkpoints``: taken after a step,
restored instead of a prepare (``_checkpointing``).

Several workers (one per device, L42) take from the pool's one queue of new
requests (see ``_pool``); a request lives its whole life on the worker that took
it. A worker that dies fails only what it holds (L43): its thread's last act is to
discard its states and say so.

Preemption (L61), with a runner that declares ``suspendable``: when the
best-ranked request this worker could take has a strictly higher priority than a
running one and cannot start otherwise (the batch is full, has another batch key,
or takes no joins), the plan names victims: the lowest-ranked running member, or
the whole batch when only an empty batch lets the newcomer start; between tenants of
one priority, a member of a tenant over its share of a full batch (L61 amended),
counted over the worker's recent full steps (``RecentSteps``, which the step loop
feeds after each step that ran to its end). Outside the
lock the worker asks the runner what parking them would hold; if that fits
``max_parked_bytes`` and the plan still stands (the policy, asked again under the
lock, plans the same), it reserves the newcomer (takes it), suspends the victims
into its own queue of parked requests (``_parking``), at the rank they had, and
prepares the newcomer at the same boundary. A request is suspended at most
``max_preemptions`` times. A suspended request reads WAITING; when this worker takes
it again the runner resumes it from the step it reached. One that the event loop
withdraws (abort, deadline, shutdown) is released by the materializer thread at once,
never decoded.

Holds (L102, L103): while the engine updates its weights or sleeps, the pool's hold
keeps new requests (or all) out of the plan; with ``suspend`` the worker suspends its
running requests at the next boundary (``_suspend``) and posts ``Held`` once idle.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

from ._cacheplan import loosen_at_risk
from ._cancelpoint import Leave, armed
from ._checkpointing import restored, take_checkpoints
from ._imagecheck import checked_images
from ._log import WORKER
from ._materialize import Materializer
from ._messages import Exited, Held, Post, Stepped, died, discard_quietly, release
from ._outputs import WorkerStatistics
from ._parking import Parking
from ._pool import Hold
from ._queue import WaitingQueue
from ._reasons import AbortReason
from ._runner import Runner, StopRun, SuspendableRunner
from ._scheduler import (
    BoundaryPlan,
    BoundaryRules,
    Member,
    Preemption,
    RecentSteps,
    RunningBatch,
    plan_boundary,
    plan_preemption,
    sources,
)
from ._steptimes import StepTimes
from ._suspend import Suspender
from ._wholecall import run_whole
from ._workitem import WorkItem

if TYPE_CHECKING:
    from ._config import EngineConfig
    from ._pool import Pool

__all__ = ["Worker"]

#: The weight of the newest step in the moving average of step durations: about
#: the last ten steps count (picked without measurement).
_STEP_WEIGHT = 0.2


def _averaged(average: float | None, value: float) -> float:
    """``average`` moved towards ``value`` by ``_STEP_WEIGHT``; ``value`` if there is none."""
    return value if average is None else average + _STEP_WEIGHT * (value - average)


class Worker:
    """Owns one runner, its step-loop thread, its materializer and its parked requests."""

    def __init__(
        self,
        runner: Runner[Any],
        config: EngineConfig,
        pool: Pool,
        *,
        index: int,
        post: Post,
        post_quietly: Post,
        name: str,
    ) -> None:
        capabilities = runner.capabilities
        self.index = index
        self.name = name
        self._runner = runner
        self._pool = pool
        self._cond = pool.cond
        self._post = post
        self._post_quietly = post_quietly
        self._max_batch = min(config.max_batch_size, capabilities.max_batch_size)
        self._previews = capabilities.previews
        self._whole_call = capabilities.whole_call
        self._cancel_points = capabilities.cancel_points
        # L84: a runner that applies step caches may have thresholds loosened.
        self._loosens = bool(capabilities.step_cache)
        # L78: a runner that takes checkpoints may be asked for them at boundaries.
        self._checkpointing = capabilities.checkpoints
        self._fatal: BaseException | None = None
        # L61: preemption (its suspended requests are ``_parking``'s).
        self._preempting = capabilities.suspendable and config.preemption
        # The boundary policy's rules (``_scheduler.plan_boundary``), and the same
        # without preemption, for the boundary that follows a preemption given up.
        self._rules = BoundaryRules(
            max_batch=self._max_batch,
            can_join=capabilities.can_join,
            preempting=self._preempting,
            max_preemptions=config.max_preemptions,
            tenant_preemption=config.tenant_preemption,
            weights=config.tenant_weights,
        )
        self._rules_no_preemption = dataclasses.replace(self._rules, preempting=False)
        # The last batch steps, which tenant preemption reads (L61 amended).
        self._recent = RecentSteps(self._rules.max_batch)
        self._max_parked_bytes = config.max_parked_bytes
        # L103: the last hold round it said it runs nothing in (``Held``).
        self._held_round = 0
        # Written by the worker thread only; the loop reads them for statistics
        # (reading one reference is atomic; a stale value is one step old).
        self.steps_run = 0
        self.batch_steps = 0
        # The running batch as admission's estimate (L62) and statistics read it:
        # one immutable view, swapped whole (``_publish``). It carries the moving
        # averages of step durations and of their cost per pixel (None until the
        # first step).
        self.batch = RunningBatch()
        self._step_s: float | None = None
        self._times = StepTimes()
        # When the step running now began (``time.perf_counter``), None between
        # steps: what a stuck worker is doing, for statistics and shutdown's log.
        self._step_started: float | None = None
        # The items behind ``batch.members``, by identity: the members are rebuilt
        # only when the batch's composition changes, not at every step.
        self._view: tuple[WorkItem, ...] = ()
        self._materializer = Materializer(runner, post, self._die, name=f"{name}-materializer")
        # Its suspended requests, under the lock (the loop reads their counts).
        self._parking = Parking(pool.new_queue(), self._materializer)
        self._suspender = Suspender(
            runner, pool.cond, self._parking, post, self._publish, to_host=config.park_on_host
        )
        self._thread = threading.Thread(target=self._run, name=f"{name}-worker", daemon=False)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads this worker owns."""
        return (self._thread, self._materializer.thread)

    def start(self) -> None:
        """Start the threads."""
        self._materializer.start()
        self._thread.start()

    @property
    def max_batch(self) -> int:
        """The most requests one step runs together (the engine's and the runner's limit)."""
        return self._max_batch

    @property
    def rules(self) -> BoundaryRules:
        """The rules its boundaries obey (admission's estimate applies them too, L62)."""
        return self._rules

    @property
    def running(self) -> int:
        """The members of its batch now (statistics)."""
        return len(self.batch.members)

    @property
    def holding(self) -> tuple[str, ...]:
        """The ids of the requests its threads hold now: its batch, and what it decodes."""
        ids = tuple(member.item for member in self.batch.members)
        decoding = self._materializer.decoding
        return ids if decoding is None or decoding in ids else (*ids, decoding)

    @property
    def in_step_s(self) -> float | None:
        """How long the step running now has run, in seconds; ``None`` between steps."""
        started = self._step_started
        return None if started is None else time.perf_counter() - started

    def statistics(self, *, alive: bool) -> WorkerStatistics:
        """Its counts now (L43): ``alive`` is the engine's word, which learns of a death."""
        return WorkerStatistics(
            name=self.name,
            alive=alive,
            running=self.running,
            steps_run=self.steps_run,
            batch_steps=self.batch_steps,
            preemptions=self.preemptions,
            holding=self.holding,
            in_step_s=self.in_step_s,
        )

    @property
    def thread_names(self) -> tuple[str, ...]:
        """The names of its threads that are still alive."""
        return tuple(thread.name for thread in self.threads if thread.is_alive())

    def assume_step_time(self, step_s: float, *, shapes: Mapping[int, float] | None = None) -> None:
        """Read ``step_s`` (and ``shapes``' warm figures) as measured until the next step is
        measured.

        For ``omni_trio.testing.assume_step_time``: call it while this worker is
        held in a step or idle, so that nothing publishes meanwhile.
        """
        self._step_s = step_s
        if shapes is not None:
            self._times.assume(shapes)
        self.batch = dataclasses.replace(self.batch, step_s=step_s, shapes=self._times.view())

    @property
    def parked(self) -> WaitingQueue[WorkItem]:
        """Its suspended requests' queue (L61); read under the lock."""
        return self._parking.queue

    @property
    def parked_bytes(self) -> int:
        """The bytes its suspended requests park now; read under the lock."""
        return self._parking.bytes

    @property
    def preemptions(self) -> int:
        """The suspensions it made in all."""
        return self._parking.preemptions

    def let_go(self, item: WorkItem) -> bool:
        """Withdraw ``item`` if it is suspended here: its release follows. Under the lock."""
        return self._parking.let_go(item)

    def let_go_all(self) -> list[WorkItem]:
        """Withdraw every suspended item here: their releases follow. Under the lock."""
        return self._parking.let_go_all()

    def orphan_parked(self) -> None:
        """This worker died: take its suspended requests out, for its thread to discard.

        Under the lock. Once the thread has exited nothing is parked any more.
        """
        self._parking.orphan_all()

    def join(self) -> None:
        """Wait for both threads; call after the ``Exited`` message."""
        for thread in self.threads:
            thread.join()

    def fail(self, exc: BaseException) -> None:
        """Its runner broke outside its threads (an adapter's load, L23): the worker
        raises ``exc`` at its next boundary and dies, as of its own failure."""
        self._die(exc)

    def _die(self, exc: BaseException) -> None:
        # The materializer died: the worker raises it at its next boundary.
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._cond.notify_all()

    def _run(self) -> None:
        # Logged at start and end only: never from the step loop itself.
        WORKER.debug("%s started", self._thread.name)
        running: list[WorkItem] = []
        dead = False
        try:
            while not self._serve_boundary(running):
                if running:
                    self._step(running)
        except BaseException as exc:
            # L23, L43: a BaseException that is not an Exception (KeyboardInterrupt,
            # SystemExit, a cancellation, the runner's own) leaves the runner in a
            # state nobody can vouch for: the worker dies, it does not fail a batch.
            dead = True
            # The engine fails what this worker holds; free what the runner holds.
            for item in running:
                discard_quietly(self._runner, item)
            self._post(died(exc, f"the engine's worker {self.name} died", worker=self.index))
        finally:
            running.clear()
            self._publish(running)
            self._materializer.stop(abandon=dead or self._fatal is not None)
            self._materializer.thread.join()
            with self._cond:
                # What a dead worker leaves parked; from now on the loop hands
                # nothing to the materializer.
                parked = self._parking.close()
            self._materializer.discard_leftovers()
            for item in parked:
                discard_quietly(self._runner, item)
            del parked
            try:
                self._runner.close()
            except BaseException as exc:
                if not dead:
                    dead = True
                    self._post(died(exc, "the runner's close raised", worker=self.index))
            if self._fatal is not None and not dead:
                what = f"the engine's materializer {self.name} died"
                self._post(died(self._fatal, what, worker=self.index))
            WORKER.debug("%s exited; the runner is closed", self._thread.name)
            self._post(Exited(self.index))

    def _serve_boundary(self, running: list[WorkItem]) -> bool:
        """Drop, preempt, admit and prepare at a step boundary; return whether to stop.

        A method of its own so that no loop variable outlives it: an idle worker
        holds no request (L14).
        """
        if running and self._pool.hold is Hold.SUSPEND:
            self._suspender.suspend_all(running)  # L103: read unlocked: a step late at worst
        plan = self._boundary(running, preempting=self._preempting)
        self._release_all(plan.drop)
        admitted: Sequence[WorkItem] = plan.admit
        if plan.preempt is not None:
            admitted = self._preempt(running, plan.preempt)
        for index, item in enumerate(admitted):
            try:
                self._prepare(item, running, admitted[index + 1 :])
            except BaseException:
                # The worker dies (L23): these states are in no list it discards.
                for rest in admitted[index:]:
                    discard_quietly(self._runner, rest)
                raise
        if self._loosens:
            self._loosen(running)
        return plan.stop

    def _loosen(self, running: list[WorkItem]) -> None:
        """L84: loosen the step caches of members whose deadline is at risk."""
        failed = loosen_at_risk(self._runner, running, self._step_s)
        if not failed:
            return
        for item, _ in failed:
            running.remove(item)
        # Published before any release is posted, as at every boundary (L62).
        self._publish(running)
        for item, exc in failed:
            release(self._runner, item, self._post, exc, call="set_cache_threshold")

    def _release_all(self, dropped: Sequence[WorkItem]) -> None:
        for index, item in enumerate(dropped):
            try:
                release(self._runner, item, self._post, None)
            except BaseException:
                # The worker dies (L23); the states of the others dropped here are in no
                # list the dying worker discards: free them now.
                for rest in dropped[index + 1 :]:
                    discard_quietly(self._runner, rest)
                raise

    def _publish(self, items: Sequence[WorkItem]) -> None:
        """Swap in the view of the batch ``items``, which admission reads (L62).

        Called whenever the batch changes, and always before the release of a
        member that left it is posted: whoever hears of that release (an
        ``await engine.abort()`` that returned) reads a batch without it.
        """
        view = tuple(items)
        members = self.batch.members
        if len(view) != len(self._view) or any(
            new is not old for new, old in zip(view, self._view, strict=True)
        ):
            members = tuple(
                Member(
                    item=item.request_id,
                    key=item.batch_key,
                    rank=item.rank(),
                    preemptions=item.preemptions,
                    stopped=False,
                    tenant=item.request.tenant,
                )
                for item in view
            )
            self._view = view
        self.batch = RunningBatch(
            members=members,
            steps=tuple((item.steps_done, item.steps_total) for item in view),
            step_s=self._step_s,
            shapes=self._times.view(),
            recent=self._recent.view(),
        )

    def _measured(self, elapsed: float, key: Hashable, pixels: Sequence[int]) -> None:
        """Fold one batch step's duration, its members of ``pixels`` each, into the figures.

        One moving average per worker, not one per batch key, for the deadline's
        estimate (coarse anyway), and the fastest warm steps by shape for the step
        time's bound (``_steptimes``); the next ``_publish`` hands them to admission.
        And the pool's per batch key, which prices requests for fair share (L57).
        """
        self._step_s = _averaged(self._step_s, elapsed)
        self._times.measured(pixels, elapsed)
        self._pool.costs.measured(key, elapsed, sum(pixels))

    def _members(self, running: list[WorkItem]) -> list[Member[WorkItem]]:
        """The running batch as the boundary policy sees it; under the lock."""
        return [
            Member(
                item=item,
                key=item.batch_key,
                rank=item.rank(),
                preemptions=item.preemptions,
                stopped=item.token.reason is not None,
                tenant=item.request.tenant,
            )
            for item in running
        ]

    def _boundary(self, running: list[WorkItem], *, preempting: bool) -> BoundaryPlan[WorkItem]:
        """Plan this boundary under the lock and apply what the lock covers; return the plan.

        The policy is ``plan_boundary``'s; here ``running`` becomes the members it
        keeps, what it takes becomes this worker's, and with nothing to do the
        worker waits on the condition. With ``preempting`` and a preemption to
        make, nothing is admitted: ``_preempt`` carries the plan out.
        """
        pool = self._pool
        rules = self._rules if preempting else self._rules_no_preemption
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                fresh, parked = pool.queues_for(self.parked)
                plan = plan_boundary(
                    self._members(running),
                    fresh=fresh,
                    parked=parked,
                    rules=rules,
                    stopping=pool.stopping,
                    idle=pool.idle,
                    recent=self._recent.view(),
                )
                running[:] = plan.keep
                if plan.stop:
                    for item in plan.drop:
                        self._parking.hold(item)  # held here until released: running
                        item.token.cancel(AbortReason.SHUTDOWN)
                if not plan.wait:
                    self._taken(plan.admit)
                    if plan.drop or plan.admit:
                        # Under the lock, as the queues change, and before any
                        # release is posted: the batch about to step (L62).
                        self._publish([*running, *plan.admit])
                    return plan
                # Idle from here: nothing is left in the batch to count or estimate.
                if self.batch.members:
                    self._publish(running)
                if pool.hold is Hold.SUSPEND and self._held_round != pool.hold_round:
                    self._held_round = pool.hold_round
                    self._post(Held(self.index, pool.hold_round))  # L103: nothing runs here
                pool.idle += 1
                try:
                    self._cond.wait()
                finally:
                    pool.idle -= 1

    def _taken(self, items: Sequence[WorkItem]) -> None:
        """Mark ``items`` as this worker's, running on the weights now; under the lock."""
        for item in items:
            self._parking.hold(item)
            item.worker = self.index
            item.weights = self._pool.weights

    def _preempt(self, running: list[WorkItem], plan: Preemption[WorkItem]) -> Sequence[WorkItem]:
        """Carry out a plan: suspend its victims for its newcomer; return what to admit.

        Outside the lock: the runner's calls. All or nothing: if parking every
        victim would pass ``max_parked_bytes``, or the plan no longer stands once
        the sizes are known (the queue changed meanwhile), nothing is suspended and
        the boundary goes on without preemption, as it does when a victim's
        ``state_bytes`` raises (that victim fails). A victim whose ``suspend`` raises
        fails (it leaves the batch anyway); one aborted meanwhile is released
        instead of parked.
        """
        victims, newcomer = plan.victims, plan.newcomer
        measured, sizes = self._suspender.measured(running, victims)
        if len(measured) < len(victims):
            return self._no_preemption(running)
        limit = self._max_parked_bytes
        with self._cond:
            fits = limit is None or self.parked_bytes + sum(sizes) <= limit
            stands = fits and self._replan(running) == plan
            if stands:
                # Reserved: it is this worker's from now on, whatever the suspensions do.
                if not self._pool.fresh.claim(newcomer):
                    self.parked.claim(newcomer)
                self._taken([newcomer])
                self._publish([*running, newcomer])
        if not stands:
            return self._no_preemption(running)
        self._suspender.park(running, victims, sizes, [newcomer])
        return [newcomer]

    def _replan(self, running: list[WorkItem]) -> Preemption[WorkItem] | None:
        """The preemption the policy would plan now; under the lock."""
        pool = self._pool
        fresh, parked = pool.queues_for(self.parked)
        queues = sources(fresh, parked, busy=bool(running), idle=pool.idle)
        return plan_preemption(self._members(running), queues, self._rules, self._recent.view())

    def _no_preemption(self, running: list[WorkItem]) -> Sequence[WorkItem]:
        plan = self._boundary(running, preempting=False)
        self._release_all(plan.drop)
        return plan.admit

    def _prepare(
        self, item: WorkItem, running: list[WorkItem], pending: Sequence[WorkItem]
    ) -> None:
        """Prepare (or resume) an admitted ``item`` into ``running``; ``pending`` come next."""
        if item.state is not None:
            self._resume(item, running, pending)
            return
        item.t_taken = item.t_run = started = time.perf_counter()
        try:
            if item.resume_from is not None:
                item.state = restored(self._runner, item)
            if item.state is None:
                item.state = self._runner.prepare(item.request, item.request_id)
        except Exception as exc:
            self._publish([*running, *pending])
            release(self._runner, item, self._post, exc, call="prepare")
            return
        item.prepare_s = time.perf_counter() - started
        running.append(item)

    def _resume(self, item: WorkItem, running: list[WorkItem], pending: Sequence[WorkItem]) -> None:
        """A suspended request is back: the runner brings its state back (L61)."""
        try:
            cast("SuspendableRunner[Any]", self._runner).resume(item.state)
        except Exception as exc:
            self._publish([*running, *pending])
            release(self._runner, item, self._post, exc, call="resume")
            return
        now = item.t_run = time.perf_counter()
        suspended = item.t_suspended
        if suspended is not None:
            item.suspended_s += now - suspended
            item.t_suspended = None
        running.append(item)

    def _step(self, running: list[WorkItem]) -> None:
        if self._whole_call:
            for item in running:
                run_whole(self._runner, self._post, item, self)  # publishes () first
            running.clear()
            return
        self._step_started = started = time.perf_counter()
        # L71: leave the step only when nobody is left to want it.
        leave = Leave(lambda: all(item.token.reason is not None for item in running))
        try:
            # No local holds the states: a failure's traceback keeps this frame (L22).
            with armed(leave) if self._cancel_points else nullcontext():
                try:
                    self._runner.step([item.state for item in running])
                finally:
                    self._step_started = None
        except StopRun as stop:
            if not leave.left:
                self._fail_batch(running, stop)
                return
            # Left mid-step: no step counted, none measured; each keeps its own reason.
            dropped = running[:]
            running.clear()
            self._publish(running)
            self._release_all(dropped)
            return
        except Exception as exc:
            self._fail_batch(running, exc)
            return
        elapsed = time.perf_counter() - started
        self.batch_steps += 1
        self._recent.ran([(item.request.priority, item.request.tenant) for item in running])
        self._measured(elapsed, running[0].batch_key, [item.step_pixels for item in running])
        stepped = [(item, self._stepped(item, elapsed)) for item in running]
        running[:] = [
            item for item, error in stepped if error is None and item.steps_done < item.steps_total
        ]
        self._publish(running)
        if self._checkpointing:
            take_checkpoints(self._runner, self._materializer, running)
        for item, error in stepped:
            if error is not None:
                release(self._runner, item, self._post, error, call="preview")
            elif item.steps_done >= item.steps_total:
                self.denoised(item)

    def _fail_batch(self, running: list[WorkItem], exc: Exception) -> None:
        """L22: the whole batch of this step fails; the engine goes on."""
        batch = tuple(item.request_id for item in running)
        self._publish(())
        for item in running:
            release(self._runner, item, self._post, exc, call="step", batch=batch)
        running.clear()

    def _stepped(self, item: WorkItem, elapsed: float) -> Exception | None:
        """Count one step of ``item`` and post its event; return a preview's error.

        The error is what ``preview`` raised, or an ``InvalidOutputError`` for a
        preview that breaks the output contract.
        """
        item.steps_done += 1
        item.denoise_s += elapsed
        self.steps_run += 1
        try:
            preview = self._preview(item)
        except Exception as exc:
            return exc
        # Nobody reads this request's events (yet): do not wake the loop for it.
        post = self._post if item.reading else self._post_quietly
        post(Stepped(item, item.steps_done, item.steps_total, preview))
        return None

    # -- a whole-call runner's host (``_wholecall``) ----------------------------

    def step_done(self, item: WorkItem, elapsed: float) -> Exception | None:
        """One step of a whole-call runner's ``item``, counted, measured and posted."""
        self.batch_steps += 1
        self._recent.ran([(item.request.priority, item.request.tenant)])
        self._measured(elapsed, item.batch_key, (item.step_pixels,))
        error = self._stepped(item, elapsed)
        self._publish((item,))
        return error

    def step_begins(self, at: float | None) -> None:
        """The step running now began at ``at``; ``None`` between steps."""
        self._step_started = at

    def left_batch(self) -> None:
        """The whole-call request left the batch."""
        self._publish(())

    def denoised(self, item: WorkItem) -> None:
        """``item``'s last step is done: to the materializer, to decode (L16)."""
        item.t_denoised = now = time.perf_counter()
        item.end_run(now)
        self._materializer.put(item)

    def _preview(self, item: WorkItem) -> Any:
        every = item.request.preview_every
        # L18: only for a consumer that reads its events, every n-th step.
        if every and self._previews and item.reading and item.steps_done % every == 0:
            preview = self._runner.preview(item.state)
            if preview is not None:
                return checked_images(
                    preview, call="preview", count=item.request.num_images, size=None, own=True
                )
        return None
