"""The jobs one server holds in memory (L73): ``JobTable``, the lowest layer of ``VideoJobs``.

By id in creation order, the finished ones' expiries on the config's clock, the
sequence of ids, the bound's counts, and the list; nothing here calls the engine, a
task or a store (``_runs`` and ``_jobs`` build on it, and write through to one).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import anyio

from ._job import STATUSES, VideoConfig, VideoJob, make_id, not_found

if TYPE_CHECKING:
    from ._store import JobStore

__all__ = ["JobTable"]


class JobTable:
    """The jobs held here, and what is read of them without a store.

    Args:
        config: the bounds, the time-to-live and its clock.
    """

    def __init__(self, config: VideoConfig) -> None:
        self.config = config
        self._jobs: dict[str, VideoJob] = {}  # by creation, oldest first
        self._expiries: dict[str, float] = {}  # finished jobs: when they expire (clock)
        self._seq = 0
        self._creating: set[str] = set()  # jobs whose rows are being written
        self._wake: anyio.Event | None = None  # the sweeper's (``_jobs``)
        self._closed = False
        # The durable store (L77), open while ``serve`` runs with a video engine
        # (``_jobs``), and the expired jobs it still has, which the sweeper deletes.
        self.store: JobStore | None = None
        self._doomed: list[str] = []

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` was called: no more jobs are admitted, nor taken over."""
        return self._closed

    def held(self) -> list[str]:
        """The ids of the jobs held here whose rows are written, oldest first."""
        return [job_id for job_id in self._jobs if job_id not in self._creating]

    def _nudge(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def purge(self) -> None:
        """Drop the finished jobs whose time-to-live has passed."""
        now = self.config.clock()
        for job_id in [i for i, when in self._expiries.items() if when <= now]:
            self._drop(job_id)
            if self.store is not None:
                self._doomed.append(job_id)  # the sweeper deletes it from the store
                self._nudge()

    def _drop(self, job_id: str) -> VideoJob:
        job = self._jobs.pop(job_id)
        self._expiries.pop(job_id, None)
        job.removed = True
        job.mp4 = None  # the bytes go now, whoever still holds the job
        job.changed()
        return job

    def get(self, job_id: str, *, tenant: str | None = None) -> VideoJob:
        """The job ``job_id``.

        Args:
            tenant: with a name, only that tenant's jobs are seen (a key that is not an
                admin key, L55); ``None``: every job.

        Raises:
            ApiError: 404 ``video_not_found``: no such job (never made, deleted,
                expired), or another tenant's, which reads the same.
        """
        self.purge()
        job = self._jobs.get(job_id)
        if job is None or (tenant is not None and job.tenant != tenant):
            raise not_found(job_id)
        return job

    def running_of(self, tenant: str) -> int:
        """How many of ``tenant``'s jobs are not finished (L56); O(jobs held)."""
        return sum(1 for job in self._jobs.values() if not job.is_finished and job.tenant == tenant)

    def new_id(self) -> str:
        """A fresh job id: ``video_`` + its sequence number + random hex."""
        self._seq += 1
        return make_id(self._seq)

    def counts(self) -> dict[str, int]:
        """Jobs held now, by status."""
        self.purge()
        counts = dict.fromkeys(STATUSES, 0)
        for job in self._jobs.values():
            counts[job.status] += 1
        return counts

    def held_bytes(self) -> int:
        """The MP4 bytes the store holds now."""
        self.purge()
        return sum(job.size for job in self._jobs.values())

    def __len__(self) -> int:
        """The jobs held now (expired ones dropped first)."""
        self.purge()
        return len(self._jobs)

    def _page_here(
        self, limit: int, cursor: int | None, order: str, tenant: str | None
    ) -> tuple[list[VideoJob], bool]:
        """``page`` from the jobs held here: up to ``limit`` after the sequence number
        ``cursor``, of ``tenant`` if named; whether more follow."""
        jobs: Iterator[VideoJob] = iter(self._jobs.values())
        if order == "desc":
            jobs = reversed(self._jobs.values())
        if cursor is not None:
            after_seq = cursor
            jobs = (
                j for j in jobs if (j.seq < after_seq if order == "desc" else j.seq > after_seq)
            )
        if tenant is not None:
            jobs = (j for j in jobs if j.tenant == tenant)
        chosen: list[VideoJob] = []
        for job in jobs:
            if len(chosen) == limit:
                return chosen, True
            chosen.append(job)
        return chosen, False
