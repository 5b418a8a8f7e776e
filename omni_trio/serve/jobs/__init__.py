"""Video jobs (L73) and their durable store (L77-L79): the lifecycle over a store protocol.

Internal to ``omni_trio.serve``, whose public name of it is ``VideoConfig``; the other
names are re-exported here for ``serve``, the command line and the tests.

Layout. The store, below the lifecycle, blocking (called off the event loop):

- ``_store``: ``JobRow``, the open errors, and the protocols: ``JobStore`` (what the
  lifecycle asks of every store) and ``SharedJobStore`` (what only a store shared by
  several servers does, L79: ids, leases, takeovers, every server's jobs); and
  ``rows_query``, the list's query, which the two SQL stores share;
- ``_sqlite``: ``SqliteJobStore``, SQLite in WAL mode under ``--jobs-dir``, over
  ``_files`` (the folder's files written atomically, its lock, the tidy at open,
  ``default_jobs_dir`` and the ``OMNI_TRIO_TEST_HOLD`` test hook);
- ``_postgres``: ``PostgresJobStore`` and ``postgres_store`` (a ``VideoConfig.store``
  factory), PostgreSQL, the MP4s and checkpoints in it too, shared by servers that
  share nothing else (L98), over ``_pg_session`` (one connection, made again when it
  is lost; the ``postgres`` extra: psycopg 3, imported when a store is made);
- ``_memory``: ``MemoryJobStore`` on ``MemoryTables``, the same semantics in memory,
  for tests (tests/serve/test_job_stores.py runs one set of tests over every store:
  a new store joins by adding itself to its fixture's parameters);
- ``_writer``: ``CheckpointWriter``, the thread that writes checkpoints through a
  ``JobStore`` (L78).

The lifecycle, in the event loop, which talks to the protocols only:

- ``_record``: a job's parameters as JSON data and back, its error, its MP4 bytes;
- ``_job``: ``VideoConfig``, ``VideoJob``, ``Resumes``, the statuses and ids, and
  ``store_of``, the one place that makes a store of a config (a ``SqliteJobStore`` of
  ``jobs_dir``, or the config's ``store`` factory's);
- ``_leases``: ``LeaseKeeper``, a shared store's leases, renewals and takeovers, which
  tells the lifecycle (its ``Holder``) what it lost or took over;
- ``VideoJobs``, in three layers of one class: ``_table`` (``JobTable``: the jobs held
  in memory, their expiries, the list), ``_runs`` (``JobRuns``: each job's run,
  submitted, followed, ended and resumed, written through to the store) and
  ``_jobs`` (``VideoJobs``: the lifespan, admission, deletion, reads).

tests/test_layers.py checks that the lifecycle never imports a store's module but
through ``_job.store_of``, and that the stores import nothing of the lifecycle.
"""

from __future__ import annotations

from ._files import HOLD_VARIABLE as HOLD_VARIABLE
from ._files import default_jobs_dir as default_jobs_dir
from ._job import DEFAULT_JOBS_LEASE_S as DEFAULT_JOBS_LEASE_S
from ._job import STATUSES as STATUSES
from ._job import Resumes as Resumes
from ._job import VideoConfig as VideoConfig
from ._job import VideoJob as VideoJob
from ._jobs import VideoJobs as VideoJobs
from ._leases import LeaseKeeper as LeaseKeeper
from ._memory import MemoryJobStore as MemoryJobStore
from ._memory import MemoryTables as MemoryTables
from ._pg_session import StoreLostError as StoreLostError
from ._postgres import PostgresJobStore as PostgresJobStore
from ._postgres import postgres_store as postgres_store
from ._record import encode_mp4 as encode_mp4
from ._record import error_record as error_record
from ._record import spec_from_record as spec_from_record
from ._record import spec_record as spec_record
from ._sqlite import SqliteJobStore as SqliteJobStore
from ._store import JobRow as JobRow
from ._store import JobStore as JobStore
from ._store import SharedJobStore as SharedJobStore
from ._store import StoreBusyError as StoreBusyError
from ._store import StoreOpenError as StoreOpenError
from ._writer import CheckpointWriter as CheckpointWriter

__all__ = [
    "DEFAULT_JOBS_LEASE_S",
    "HOLD_VARIABLE",
    "STATUSES",
    "CheckpointWriter",
    "JobRow",
    "JobStore",
    "LeaseKeeper",
    "MemoryJobStore",
    "MemoryTables",
    "PostgresJobStore",
    "Resumes",
    "SharedJobStore",
    "SqliteJobStore",
    "StoreBusyError",
    "StoreLostError",
    "StoreOpenError",
    "VideoConfig",
    "VideoJob",
    "VideoJobs",
    "default_jobs_dir",
    "encode_mp4",
    "error_record",
    "postgres_store",
    "spec_from_record",
    "spec_record",
]
