"""The checkpoint writer (L78): an owned thread that keeps the jobs' checkpoints in a store.

The engine hands each checkpoint to ``CheckpointWriter.offer`` in its materializer
thread; the writer's own thread writes it through the store's ``write_checkpoint``
(``_store.JobStore``), the latest of each job first, so the step loop never waits for a
disk and a job's newer checkpoint replaces one not yet written.
"""

from __future__ import annotations

import logging
import threading
import time

from ..._checkpoint import Checkpoint
from ._store import JobStore

__all__ = ["CheckpointWriter"]

_log = logging.getLogger("omni_trio.serve")


class CheckpointWriter:
    """An owned thread that writes the jobs' checkpoints, the latest of each job first.

    ``offer`` is the engine's checkpoint sink: it never blocks on the disk (a newer
    checkpoint of a job replaces one not yet written).

    Args:
        store: where the checkpoints go.
    """

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._pending: dict[str, Checkpoint] = {}
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="omni-trio-checkpoints", daemon=False
        )
        self.written = 0

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def offer(self, checkpoint: Checkpoint) -> None:
        """Queue ``checkpoint`` (any thread); it replaces its job's unwritten one."""
        with self._changed:
            if not self._stopped:
                self._pending[checkpoint.request_id] = checkpoint
                self._changed.notify()

    def forget(self, job_id: str) -> None:
        """Drop the job's unwritten checkpoint (it finished or was deleted)."""
        with self._changed:
            self._pending.pop(job_id, None)

    def stop(self) -> None:
        """Write what is queued, then end the thread; returns once it ended."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._stopped:
                    self._changed.wait()
                if not self._pending:
                    return
                job_id = next(iter(self._pending))
                checkpoint = self._pending.pop(job_id)
            started = time.perf_counter()
            try:
                self._store.write_checkpoint(checkpoint)
            except Exception:
                _log.exception(
                    "the checkpoint of %s is not written", job_id, extra={"request_id": job_id}
                )
            else:
                self.written += 1
                _log.debug(
                    "checkpoint of %s after step %d: %d bytes in %.1f ms",
                    job_id,
                    checkpoint.step,
                    len(checkpoint.data),
                    (time.perf_counter() - started) * 1e3,
                )
            del checkpoint
