"""A worker's suspensions (L61, L103): running requests parked between two steps.

Preemption suspends the victims its plan names for a newcomer (``Worker._preempt``
decides, ``Suspender.park`` carries it out); an engine falling asleep with the policy
``suspend`` has every worker suspend every running request (``suspend_all``), to resume
exactly after the wake. Runs in the worker's thread: the runner's calls outside the
pool's lock, the parking under it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ._messages import Post, release

if TYPE_CHECKING:
    from ._parking import Parking
    from ._runner import Runner, SuspendableRunner
    from ._workitem import WorkItem

__all__ = ["Suspender"]


class Suspender:
    """Suspends a worker's running requests into its parking.

    Args:
        runner: the worker's runner (it declares ``suspendable`` when this is used).
        cond: the pool's lock.
        parking: the worker's suspended requests.
        post: the worker's way to the event loop.
        publish: the worker's ``_publish``: the batch changed.
        to_host: whether a suspended state moves to host memory (``park_on_host``).
    """

    def __init__(
        self,
        runner: Runner[Any],
        cond: threading.Condition,
        parking: Parking,
        post: Post,
        publish: Callable[[Sequence[WorkItem]], None],
        *,
        to_host: bool,
    ) -> None:
        self._runner = runner
        self._cond = cond
        self._parking = parking
        self._post = post
        self._publish = publish
        self._to_host = to_host

    def suspend_all(self, running: list[WorkItem]) -> None:
        """Suspend every member of ``running`` (L103: the engine falls asleep, ``suspend``);
        one whose ``state_bytes`` raises fails."""
        victims, sizes = self.measured(running, list(running))
        self.park(running, victims, sizes, ())

    def measured(
        self, running: list[WorkItem], items: Sequence[WorkItem]
    ) -> tuple[list[WorkItem], list[int]]:
        """Those of ``items`` whose state's size the runner reads, and their sizes; one
        whose ``state_bytes`` raises leaves ``running`` and fails."""
        runner = cast("SuspendableRunner[Any]", self._runner)
        kept: list[WorkItem] = []
        sizes: list[int] = []
        for item in items:
            try:
                sizes.append(runner.state_bytes(item.state))
            except Exception as exc:
                running.remove(item)
                self._publish(running)
                release(self._runner, item, self._post, exc, call="state_bytes")
                continue
            kept.append(item)
        return kept, sizes

    def park(
        self,
        running: list[WorkItem],
        victims: Sequence[WorkItem],
        sizes: Sequence[int],
        coming: Sequence[WorkItem],
    ) -> None:
        """Suspend ``victims`` (parking ``sizes`` bytes) out of ``running``, into the
        parked queue, at the ranks they had; ``coming`` join the batch. A victim whose
        ``suspend`` raises fails; one aborted meanwhile is released instead of parked."""
        runner = cast("SuspendableRunner[Any]", self._runner)
        for item, size in zip(victims, sizes, strict=True):
            running.remove(item)
            try:
                runner.suspend(item.state, to_host=self._to_host)
            except Exception as exc:
                self._publish([*running, *coming])
                release(self._runner, item, self._post, exc, call="suspend")
                continue
            with self._cond:
                cut = item.token.reason is not None
                if not cut:
                    self._parking.park(item, size)
                self._publish([*running, *coming])
            if cut:
                release(self._runner, item, self._post, None)
