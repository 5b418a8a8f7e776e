"""The step loop: one owned, non-daemon thread per device.

At every step boundary, under the queue lock (microseconds, never across runner
work), the worker drops the members whose token is set (L7, L21), takes the
requests that may join the batch, and decides whether to stop. Then, without the
lock, it prepares the new members, runs one runner step for the whole batch and
posts one step event per member. Members whose last step is done go to the
materializer, so the next step starts at once (L16). A whole-call runner (one that
must run its own loop) gets one request at a time, and its step callback is the
boundary: the token is checked there and ``StopRun`` raised to stop the loop. The
worker never waits for the event loop or a consumer (L20): it only posts messages.

Preemption (L61), with a runner that declares ``suspendable``: when the
best-ranked waiting request has a strictly higher priority than a running one and
cannot start otherwise (the batch is full, has another batch key, or takes no
joins), the worker suspends the lowest-ranked running member (or the whole batch,
when only an empty batch lets the newcomer start) at the boundary, puts it back in
the queue at the place it had, and takes the newcomer at once. A request is
suspended at most ``max_preemptions`` times. A suspended request reads WAITING;
when it is taken again the runner resumes it from the step it reached. One that
the event loop withdraws (abort, deadline, shutdown) is released by the
materializer thread at once, never decoded.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from ._imagecheck import checked_images
from ._log import WORKER
from ._materialize import Materializer
from ._messages import Exited, Post, Stepped, died, discard_quietly, release
from ._runner import Runner, StopRun, SuspendableRunner, WholeCallRunner
from ._scheduler import WaitingQueue
from ._workitem import SHUTDOWN, WorkItem

if TYPE_CHECKING:
    from ._config import EngineConfig

__all__ = ["Withdrawal", "Worker"]


class Withdrawal(enum.Enum):
    """What ``Worker.withdraw`` did with an item."""

    #: It was not waiting: the worker holds it and drops it at its next boundary.
    HELD = "held"
    #: Taken out of the queue; it holds nothing: the caller ends it now.
    WITHDRAWN = "withdrawn"
    #: Taken out of the queue with a suspended state: the materializer releases
    #: it, and its ``Released`` message follows.
    RELEASING = "releasing"


#: The weight of the newest step in the moving average of step durations: about
#: the last ten steps count (picked without measurement).
_STEP_WEIGHT = 0.2


class Worker:
    """Owns the waiting queue, the step-loop thread and the materializer thread."""

    def __init__(
        self,
        runner: Runner[Any],
        config: EngineConfig,
        *,
        post: Post,
        post_quietly: Post,
        name: str,
    ) -> None:
        capabilities = runner.capabilities
        self._runner = runner
        self._post = post
        self._post_quietly = post_quietly
        self._max_batch = min(config.max_batch_size, capabilities.max_batch_size)
        self._can_join = capabilities.can_join
        self._previews = capabilities.previews
        self._whole_call = capabilities.whole_call
        self._cond = threading.Condition()
        self._queue: WaitingQueue[WorkItem] = WaitingQueue()
        self._stopping = False
        self._fatal: BaseException | None = None
        # L61: preemption, and the suspended items in the queue with the bytes
        # each parks (under the lock). ``_closed``: the thread has exited and has
        # discarded them; nothing is parked from then on.
        self._preempting = capabilities.suspendable and config.preemption
        self._max_preemptions = config.max_preemptions
        self._park_on_host = config.park_on_host
        self._max_parked_bytes = config.max_parked_bytes
        self._parked: dict[WorkItem, int] = {}
        self._closed = False
        # Under the lock (the loop reads them for statistics).
        self.parked_bytes = 0
        self.preemptions = 0
        # Written by the worker thread only; the loop reads them for statistics.
        self.steps_run = 0
        self.batch_steps = 0
        # For admission's deadline estimate (L62), each one float or int, written
        # by the worker thread only and read by the loop without a lock (reading
        # one reference is atomic; a stale value is one step old): an exponential
        # moving average of step durations (None until the first step), and the
        # steps left of the running batch (its longest member's).
        self.step_s: float | None = None
        self.steps_left = 0
        self._materializer = Materializer(runner, post, self._die, name=f"{name}-materializer")
        self._thread = threading.Thread(target=self._run, name=f"{name}-worker", daemon=False)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads this worker owns."""
        return (self._thread, self._materializer.thread)

    @property
    def waiting(self) -> int:
        """How many items wait in the queue (not yet taken)."""
        with self._cond:
            return len(self._queue)

    def queue_counts(self) -> tuple[int, int]:
        """How many items wait in the queue, and how many of them are suspended."""
        with self._cond:
            return len(self._queue), len(self._parked)

    def start(self) -> None:
        """Start the threads."""
        self._materializer.start()
        self._thread.start()

    @property
    def max_batch(self) -> int:
        """The most requests one step runs together (the engine's and the runner's limit)."""
        return self._max_batch

    def enqueue(self, item: WorkItem, *, limit: int, deadline: float) -> bool:
        """Queue ``item`` unless ``limit`` items wait already; return whether queued.

        ``deadline`` is its absolute deadline, for ranking (``math.inf``: none).
        """
        with self._cond:
            if len(self._queue) >= limit:
                return False
            item.rank_deadline = deadline
            item.sequence = self._queue.push(
                item,
                item.batch_key,
                priority=item.request.priority,
                deadline=deadline,
                steps=item.request.num_steps,
            )
            self._cond.notify()
        return True

    def steps_ahead(self, priority: int) -> int:
        """The steps of the waiting requests of ``priority`` or higher."""
        with self._cond:
            return self._queue.steps_ahead(priority)

    def withdraw(self, item: WorkItem) -> Withdrawal:
        """Remove ``item`` if it still waits; say what became of it.

        Exact, under the lock: an item is in the queue, or the worker holds it.
        """
        with self._cond:
            if not self._queue.remove(item):
                return Withdrawal.HELD
            return self._let_go(item)

    def withdraw_all(self) -> tuple[list[WorkItem], list[WorkItem]]:
        """Remove every waiting item: those holding nothing, and those being released."""
        with self._cond:
            items = self._queue.drain()
            fresh: list[WorkItem] = []
            releasing: list[WorkItem] = []
            for item in items:
                kept = self._let_go(item) is Withdrawal.WITHDRAWN
                (fresh if kept else releasing).append(item)
            return fresh, releasing

    def _let_go(self, item: WorkItem) -> Withdrawal:
        """``item`` left the queue by withdrawal; under the lock."""
        if item not in self._parked:
            return Withdrawal.WITHDRAWN
        # Never once closed: the exiting thread took every parked item out first.
        assert not self._closed
        self._unpark(item)
        # The engine's threads hold it until the materializer released it.
        item.taken = True
        self._materializer.release(item)
        return Withdrawal.RELEASING

    def _unpark(self, item: WorkItem) -> None:
        """Forget ``item``'s parked bytes (it left the queue); under the lock."""
        self.parked_bytes -= self._parked.pop(item)

    def stop(self) -> None:
        """Make the worker drop its members at the next boundary and exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self) -> None:
        """Wait for both threads; call after the ``Exited`` message."""
        for thread in self.threads:
            thread.join()

    def _die(self, exc: BaseException) -> None:
        # The materializer died: the worker raises it at its next boundary.
        with self._cond:
            if self._fatal is None:
                self._fatal = exc
            self._cond.notify()

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
            # L23: a BaseException that is not an Exception (KeyboardInterrupt,
            # SystemExit, a cancellation, the runner's own) leaves the runner in a
            # state nobody can vouch for: the worker dies, it does not fail a batch.
            dead = True
            # The engine fails every request; free what the runner holds for them.
            for item in running:
                discard_quietly(self._runner, item)
            self._post(died(exc, "the engine's worker died"))
        finally:
            running.clear()
            self._materializer.stop(abandon=dead or self._fatal is not None)
            self._materializer.thread.join()
            with self._cond:
                # What a dead worker leaves parked in the queue; from now on the
                # loop hands nothing to the materializer.
                self._closed = True
                parked = list(self._parked)
                for item in parked:
                    self._queue.remove(item)
                    self._unpark(item)
            self._materializer.discard_leftovers()
            for item in parked:
                discard_quietly(self._runner, item)
            del parked
            try:
                self._runner.close()
            except BaseException as exc:
                if not dead:
                    dead = True
                    self._post(died(exc, "the runner's close raised"))
            if self._fatal is not None and not dead:
                self._post(died(self._fatal, "the engine's materializer died"))
            WORKER.debug("%s exited; the runner is closed", self._thread.name)
            self._post(Exited())

    def _serve_boundary(self, running: list[WorkItem]) -> bool:
        """Drop, admit and prepare at a step boundary; return whether to stop.

        A method of its own so that no loop variable outlives it: an idle worker
        holds no request (L14).
        """
        # At most one round of preemption per boundary: a second newcomer that
        # outranks the batch gets its place at the next boundary (one step later).
        preempt = self._preempting
        while True:
            admitted, dropped, victims, stop = self._boundary(running, preempt=preempt)
            self._release_all(dropped)
            if not victims:
                break
            self._suspend(victims, running)
            preempt = False
        for item in admitted:
            self._prepare(item, running)
        self._note_left(running)
        return stop

    def _release_all(self, dropped: list[WorkItem]) -> None:
        for index, item in enumerate(dropped):
            try:
                release(self._runner, item, self._post, None)
            except BaseException:
                # The worker dies (L23); the states of the others dropped here are in no
                # list the dying worker discards: free them now.
                for rest in dropped[index + 1 :]:
                    discard_quietly(self._runner, rest)
                raise

    def _note_left(self, running: list[WorkItem]) -> None:
        self.steps_left = max((item.steps_total - item.steps_done for item in running), default=0)

    def _measured(self, elapsed: float) -> None:
        """Fold one batch step's duration into the moving average.

        One global average, not one per batch key: admission's estimate is coarse
        anyway, and one float needs no lock (a dict of them would, to be read).
        """
        average = self.step_s
        self.step_s = elapsed if average is None else average + _STEP_WEIGHT * (elapsed - average)

    def _boundary(
        self, running: list[WorkItem], *, preempt: bool
    ) -> tuple[list[WorkItem], list[WorkItem], list[WorkItem], bool]:
        """Under the lock: (admitted, dropped, victims to suspend, whether to stop).

        With victims, nothing is admitted: they are suspended first, then the
        caller comes back for the newcomer.
        """
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                dropped = [item for item in running if item.token.reason is not None]
                if dropped:
                    running[:] = [item for item in running if item.token.reason is None]
                if self._stopping:
                    dropped += running
                    for item in self._queue.drain():
                        if item in self._parked:
                            self._unpark(item)
                        dropped.append(item)
                    running.clear()
                    for item in dropped:
                        item.token.cancel(SHUTDOWN)
                    return [], dropped, [], True
                victims = self._victims(running) if preempt else []
                if victims:
                    return [], dropped, victims, False
                admitted = self._queue.take(
                    batch_key=running[0].batch_key if running else None,
                    free=self._max_batch - len(running),
                    can_join=self._can_join,
                )
                for item in admitted:
                    item.taken = True
                    if item in self._parked:
                        self._unpark(item)
                if running or admitted or dropped:
                    return admitted, dropped, [], False
                self._cond.wait()

    def _victims(self, running: list[WorkItem]) -> list[WorkItem]:
        """The running members to suspend so the best-ranked waiting one can start (L61).

        Only members of strictly lower priority that were suspended fewer than
        ``max_preemptions`` times qualify. When the newcomer could join the batch
        but it is full, the lowest-ranked qualifying member makes room; when only
        an empty batch lets it start (another batch key, or a runner that takes no
        joins), every member must qualify, or none is suspended. Under the lock.
        """
        best = self._queue.best() if running else None
        if best is None:
            return []
        _, key, priority = best
        joinable = self._can_join and key == running[0].batch_key
        if joinable and len(running) < self._max_batch:
            return []  # it joins at this boundary anyway
        eligible = [
            item
            for item in running
            if item.request.priority < priority and item.preemptions < self._max_preemptions
        ]
        if joinable:
            return [max(eligible, key=WorkItem.rank)] if eligible else []
        return eligible if len(eligible) == len(running) else []

    def _suspend(self, victims: list[WorkItem], running: list[WorkItem]) -> None:
        """Park each victim and put it back in the queue, at its old place (L61).

        Outside the lock: the runner's calls. A victim whose parked bytes would
        pass ``max_parked_bytes`` keeps running; one whose ``suspend`` raises fails;
        one aborted meanwhile is released instead of queued.
        """
        runner = cast("SuspendableRunner[Any]", self._runner)
        limit = self._max_parked_bytes
        for item in victims:
            try:
                size = runner.state_bytes(item.state)
                if limit is not None and self.parked_bytes + size > limit:
                    continue
                runner.suspend(item.state, to_host=self._park_on_host)
            except Exception as exc:
                running.remove(item)
                release(self._runner, item, self._post, exc, call="suspend")
                continue
            running.remove(item)
            item.t_suspended = time.perf_counter()
            item.preemptions += 1
            with self._cond:
                self.preemptions += 1
                cut = item.token.reason is not None
                if not cut:
                    self._requeue(item, size)
            if cut:
                release(self._runner, item, self._post, None)

    def _requeue(self, item: WorkItem, size: int) -> None:
        """Put a suspended ``item`` back in the queue; under the lock."""
        self._queue.push(
            item,
            item.batch_key,
            priority=item.request.priority,
            deadline=item.rank_deadline,
            steps=item.steps_total - item.steps_done,
            sequence=item.sequence,
        )
        self._parked[item] = size
        self.parked_bytes += size
        item.taken = False

    def _prepare(self, item: WorkItem, running: list[WorkItem]) -> None:
        if item.state is not None:
            self._resume(item, running)
            return
        item.t_taken = started = time.perf_counter()
        try:
            item.state = self._runner.prepare(item.request, item.request_id)
        except Exception as exc:
            release(self._runner, item, self._post, exc, call="prepare")
            return
        item.prepare_s = time.perf_counter() - started
        running.append(item)

    def _resume(self, item: WorkItem, running: list[WorkItem]) -> None:
        """A suspended request is back: the runner brings its state back (L61)."""
        try:
            cast("SuspendableRunner[Any]", self._runner).resume(item.state)
        except Exception as exc:
            release(self._runner, item, self._post, exc, call="resume")
            return
        suspended = item.t_suspended
        if suspended is not None:
            item.suspended_s += time.perf_counter() - suspended
            item.t_suspended = None
        running.append(item)

    def _step(self, running: list[WorkItem]) -> None:
        if self._whole_call:
            for item in running:
                self._run_whole(item)
            running.clear()
            self.steps_left = 0
            return
        started = time.perf_counter()
        try:
            self._runner.step([item.state for item in running])
        except Exception as exc:
            # L22: the whole batch of this step fails; the engine goes on.
            batch = tuple(item.request_id for item in running)
            for item in running:
                release(self._runner, item, self._post, exc, call="step", batch=batch)
            running.clear()
            return
        elapsed = time.perf_counter() - started
        self.batch_steps += 1
        self._measured(elapsed)
        keep: list[WorkItem] = []
        for item in running:
            error = self._stepped(item, elapsed)
            if error is not None:
                release(self._runner, item, self._post, error, call="preview")
            elif item.steps_done >= item.request.num_steps:
                self._denoised(item)
            else:
                keep.append(item)
        running[:] = keep
        self._note_left(running)

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

    def _denoised(self, item: WorkItem) -> None:
        item.t_denoised = time.perf_counter()
        self._materializer.put(item)

    def _run_whole(self, item: WorkItem) -> None:
        """Run a whole-call runner's own loop; its step callback is our step boundary."""
        last = time.perf_counter()
        error: Exception | None = None

        def on_step(total: int | None = None) -> None:
            nonlocal last, error
            if total is not None:
                item.steps_total = total
            now = time.perf_counter()
            self.batch_steps += 1
            self._measured(now - last)
            error = self._stepped(item, now - last)
            self.steps_left = item.steps_total - item.steps_done
            last = now
            # L7, L21: the boundary check; raising stops the loop before any decode.
            if error is not None or item.token.reason is not None:
                raise StopRun

        runner = cast("WholeCallRunner[Any]", self._runner)
        try:
            runner.run(item.state, on_step)
        except StopRun as stop:
            if error is None and item.token.reason is None:
                # Not ours: the runner stopped itself. A failure, not a cancellation.
                release(self._runner, item, self._post, stop, call="run")
            else:
                release(self._runner, item, self._post, error, call="preview")
        except Exception as exc:
            release(self._runner, item, self._post, exc, call="run")
        else:
            if error is not None:
                # The runner swallowed the StopRun raised for a bad preview (L24).
                release(self._runner, item, self._post, error, call="preview")
            else:
                self._denoised(item)

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
