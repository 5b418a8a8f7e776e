"""Decode finished requests and copy their images to the host, off the step loop.

The worker hands a request whose last step is done to this thread and goes on
with the next step at once (L16). Here the request's token is checked before the
decode (L21): an aborted request is never decoded (L10). Shutdown does not stop a
request whose denoising finished: its result is complete work and is delivered.
The decoded images are checked against the output contract here too (see
``_imagecheck``), off the event loop: a bad output fails its request, unseen.

With a runner that declares ``cancel_points`` (L72), the decode runs armed with a
check that the runner's ``cancel_point()`` calls between the decode's chunks
(the latent frames of a video, for Wan): an abort during the decode leaves it at
the next chunk, and the request is released undecoded. Shutdown cuts no decode (the
request finished denoising); only a dying engine abandons one.

It also makes checkpoints bytes (L78): the worker hands it a copy of a state at a
step boundary; here the runner serializes it and the request's sink gets it, off
the step loop and off the event loop. A failing sink is logged, never fatal.

It also releases, undecoded, the suspended requests that the event loop takes
out of the queue (an abort, a deadline, shutdown: L61), so their parked state is
freed at once, not at the step loop's next boundary.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from ._cancelpoint import Leave, armed
from ._checkpoint import Checkpoint
from ._imagecheck import checked_images, checked_video
from ._log import WORKER
from ._messages import Completed, Post, discard_quietly, discard_state, ended, release
from ._reasons import AbortReason
from ._results import keep_output
from ._runner import CheckpointRunner, Runner, StopRun, TrajectoryRunner
from ._workitem import WorkItem

__all__ = ["Materializer"]


def _cut(item: WorkItem) -> bool:
    reason = item.token.reason
    return reason is not None and reason != AbortReason.SHUTDOWN


class _LeftDecode(Exception):
    """The decode was left at a cancel point: the request stopped meanwhile (L72)."""


class Materializer:
    """An owned thread that decodes finished requests in arrival order."""

    def __init__(
        self,
        runner: Runner[Any],
        post: Post,
        on_fatal: Callable[[BaseException], None],
        *,
        name: str,
    ) -> None:
        self._runner = runner
        self._post = post
        self._on_fatal = on_fatal
        # Decodes in arrival order, and releases of suspended requests, which go
        # first (freeing parked state should not wait behind a decode backlog).
        self._lock = threading.Condition()
        self._decodes: collections.deque[WorkItem] = collections.deque()
        self._releases: collections.deque[WorkItem] = collections.deque()
        self._checkpoints: collections.deque[tuple[WorkItem, object, int]] = collections.deque()
        self._stopped = False
        self._abandon = False
        self._cancel_points = runner.capabilities.cancel_points
        # The id of the request whose decode runs now (statistics, shutdown's log).
        self.decoding: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)

    @property
    def thread(self) -> threading.Thread:
        """The materializer's thread."""
        return self._thread

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def put(self, item: WorkItem) -> None:
        """Queue ``item`` (its steps done) for decoding; never blocks."""
        with self._lock:
            self._decodes.append(item)
            self._lock.notify()

    def release(self, item: WorkItem) -> None:
        """Queue ``item`` (cancelled, unfinished) to be released undecoded, first; never blocks."""
        with self._lock:
            self._releases.append(item)
            self._lock.notify()

    def checkpoint(self, item: WorkItem, copy: object, step: int) -> None:
        """Queue ``copy`` of ``item``'s state after ``step`` to be made a checkpoint (L78)."""
        with self._lock:
            self._checkpoints.append((item, copy, step))
            self._lock.notify()

    def stop(self, *, abandon: bool = False) -> None:
        """Let the thread finish what is queued, then exit.

        With ``abandon`` (the engine died), queued requests are discarded undecoded.
        """
        with self._lock:
            self._abandon = abandon
            self._stopped = True
            self._lock.notify()

    def discard_leftovers(self) -> None:
        """Discard what a dead thread left queued; call after joining it."""
        with self._lock:
            items = [*self._releases, *self._decodes]
            self._releases.clear()
            self._decodes.clear()
            self._checkpoints.clear()
        for item in items:
            discard_quietly(self._runner, item)

    def _next(self) -> tuple[WorkItem, bool] | None:
        """The next job, (item, decode it?), or ``None`` to exit once all is done.

        Checkpoints due are made on the way, before any decode: they are small.
        """
        with self._lock:
            while True:
                if self._releases:
                    return self._releases.popleft(), False
                if self._checkpoints:
                    item, copy, step = self._checkpoints.popleft()
                    self._lock.release()
                    try:
                        self._checkpoint(item, copy, step)
                    finally:
                        del item, copy
                        self._lock.acquire()
                    continue
                if self._decodes:
                    return self._decodes.popleft(), True
                if self._stopped:
                    return None
                self._lock.wait()

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            item, finished = job
            del job
            try:
                if finished:
                    self._materialize(item)
                else:
                    release(self._runner, item, self._post)
            except BaseException as exc:
                discard_quietly(self._runner, item)
                self._on_fatal(exc)
                return
            finally:
                # An idle thread must not keep the last request alive (L14).
                del item

    def _checkpoint(self, item: WorkItem, copy: object, step: int) -> None:
        """Make ``copy`` bytes and hand them to the request's sink; log what fails."""
        policy = item.checkpoint
        if policy is None or self._abandon or item.token.reason is not None:
            return  # stopped meanwhile: nobody resumes it
        runner = cast("CheckpointRunner[Any]", self._runner)
        try:
            data = runner.checkpoint_bytes(copy)
            policy.sink(
                Checkpoint(request_id=item.request_id, step=step, total=item.steps_total, data=data)
            )
        except Exception as exc:
            WORKER.warning(
                "the checkpoint of %s after step %d is lost (%s: %s)",
                item.request_id,
                step,
                type(exc).__name__,
                exc,
                extra={"request_id": item.request_id},
            )

    def _materialize(self, item: WorkItem) -> None:
        if self._abandon or _cut(item):
            release(self._runner, item, self._post)
            return
        started = time.perf_counter()
        request = item.request
        video = None
        try:
            # The runner's own object is dropped here, in this thread, once checked.
            if request.num_frames is None:
                images = checked_images(
                    self._decode(item),
                    call="decode",
                    count=request.num_images,
                    size=(request.height, request.width),
                )
            else:
                # L70: every frame keeps the image contract; the images are the first frames.
                video = checked_video(
                    self._decode(item),
                    call="decode",
                    count=request.num_images,
                    frames=request.num_frames,
                    size=(request.height, request.width),
                )
                images = video[:, 0]
        except _LeftDecode:
            release(self._runner, item, self._post)  # L72: cancelled, undecoded
            return
        except Exception as exc:
            release(self._runner, item, self._post, exc, call="decode")
            return
        item.decode_s = time.perf_counter() - started
        trajectory = None
        if request.return_trajectory:
            try:  # L100: read before the state is discarded
                trajectory = cast("TrajectoryRunner[Any]", self._runner).trajectory(item.state)
            except Exception as exc:
                release(self._runner, item, self._post, exc, call="trajectory")
                return
        error = discard_state(self._runner, item)
        if error is not None or _cut(item):
            # An abort that arrived during the decode wins: the image is dropped
            # unseen, so an aborted request never produces an output.
            del images, video
            self._post(ended(item, error, "discard"))
            return
        # L95: the result cache's own copy, made here, off the loop; never the consumer's.
        tensor = images if video is None else video
        keep = 0 < tensor.numel() * tensor.element_size() <= item.keep_result
        kept = keep_output(images, video) if keep else None
        del tensor
        # Hand the images over without keeping a reference in this frame: the
        # consumer may drop them the moment the loop delivers them (L12).
        completed = [Completed(item, images, video, kept, trajectory)]
        del images, video, trajectory
        self._post(completed.pop())

    def _decode(self, item: WorkItem) -> Any:
        """The runner's decode of ``item``; with cancel points, left when it is cut (L72).

        Raises:
            _LeftDecode: our check stopped the decode (a ``StopRun`` that the
                runner raised on its own is a failure, as any other exception).
        """
        self.decoding = item.request_id
        try:
            if not self._cancel_points:
                return self._runner.decode(item.state)
            # L72: left only for an abort or a dying engine; shutdown lets a finished
            # request be decoded.
            leave = Leave(lambda: self._abandon or _cut(item))
            try:
                with armed(leave):
                    return self._runner.decode(item.state)
            except StopRun:
                if leave.left:
                    raise _LeftDecode from None
                raise
        finally:
            self.decoding = None
