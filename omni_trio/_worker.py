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
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from ._imagecheck import checked_images
from ._log import WORKER
from ._materialize import Materializer
from ._messages import Exited, Post, Stepped, died, discard_quietly, release
from ._runner import Runner, StopRun, WholeCallRunner
from ._scheduler import WaitingQueue
from ._workitem import SHUTDOWN, WorkItem

__all__ = ["Worker"]

#: The weight of the newest step in the moving average of step durations: about
#: the last ten steps count (picked without measurement).
_STEP_WEIGHT = 0.2


class Worker:
    """Owns the waiting queue, the step-loop thread and the materializer thread."""

    def __init__(
        self,
        runner: Runner[Any],
        *,
        max_batch_size: int,
        post: Post,
        post_quietly: Post,
        name: str,
    ) -> None:
        capabilities = runner.capabilities
        self._runner = runner
        self._post = post
        self._post_quietly = post_quietly
        self._max_batch = min(max_batch_size, capabilities.max_batch_size)
        self._can_join = capabilities.can_join
        self._previews = capabilities.previews
        self._whole_call = capabilities.whole_call
        self._cond = threading.Condition()
        self._queue: WaitingQueue[WorkItem] = WaitingQueue()
        self._stopping = False
        self._fatal: BaseException | None = None
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
            request = item.request
            self._queue.push(
                item,
                item.batch_key,
                priority=request.priority,
                deadline=deadline,
                steps=request.num_steps,
            )
            self._cond.notify()
        return True

    def steps_ahead(self, priority: int) -> int:
        """The steps of the waiting requests of ``priority`` or higher."""
        with self._cond:
            return self._queue.steps_ahead(priority)

    def withdraw(self, item: WorkItem) -> bool:
        """Remove ``item`` if it still waits; return whether it did."""
        with self._cond:
            return self._queue.remove(item)

    def withdraw_all(self) -> list[WorkItem]:
        """Remove every waiting item."""
        with self._cond:
            return self._queue.drain()

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
            self._materializer.discard_leftovers()
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
        admitted, dropped, stop = self._boundary(running)
        for index, item in enumerate(dropped):
            try:
                release(self._runner, item, self._post, None)
            except BaseException:
                # The worker dies (L23); the states of the others dropped here are in no
                # list the dying worker discards: free them now.
                for rest in dropped[index + 1 :]:
                    discard_quietly(self._runner, rest)
                raise
        for item in admitted:
            self._prepare(item, running)
        self._note_left(running)
        return stop

    def _note_left(self, running: list[WorkItem]) -> None:
        self.steps_left = max((item.steps_total - item.steps_done for item in running), default=0)

    def _measured(self, elapsed: float) -> None:
        """Fold one batch step's duration into the moving average.

        One global average, not one per batch key: admission's estimate is coarse
        anyway, and one float needs no lock (a dict of them would, to be read).
        """
        average = self.step_s
        self.step_s = elapsed if average is None else average + _STEP_WEIGHT * (elapsed - average)

    def _boundary(self, running: list[WorkItem]) -> tuple[list[WorkItem], list[WorkItem], bool]:
        with self._cond:
            while True:
                if self._fatal is not None:
                    raise self._fatal
                dropped = [item for item in running if item.token.reason is not None]
                if dropped:
                    running[:] = [item for item in running if item.token.reason is None]
                if self._stopping:
                    dropped += running
                    dropped += self._queue.drain()
                    running.clear()
                    for item in dropped:
                        item.token.cancel(SHUTDOWN)
                    return [], dropped, True
                admitted = self._queue.take(
                    batch_key=running[0].batch_key if running else None,
                    free=self._max_batch - len(running),
                    can_join=self._can_join,
                )
                for item in admitted:
                    item.taken = True
                if running or admitted or dropped:
                    return admitted, dropped, False
                self._cond.wait()

    def _prepare(self, item: WorkItem, running: list[WorkItem]) -> None:
        item.t_taken = started = time.perf_counter()
        try:
            item.state = self._runner.prepare(item.request, item.request_id)
        except Exception as exc:
            release(self._runner, item, self._post, exc, call="prepare")
            return
        item.prepare_s = time.perf_counter() - started
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
