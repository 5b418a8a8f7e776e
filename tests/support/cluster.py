"""Servers that share nothing but PostgreSQL and an object store (L79, L97, L98).

What tests/serve/test_cluster_kill.py and the ``cluster`` benchmark share: a node's
command line (``node_args``), a job's row as the database holds it (``job_row``: its
owner, its lease, its steps and checkpoint, read straight from ``video_jobs``), the
server that owns a job (``owner_pid``) and an MP4's magic bytes (``is_mp4``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["JOB_COLUMNS", "is_mp4", "job_row", "node_args", "owner_pid"]

#: The columns of ``video_jobs`` that ``job_row`` reads.
JOB_COLUMNS = ("status", "progress", "step", "checkpoint_step", "owner", "lease", "resumes")


def node_args(
    *, dsn: str, lease_s: float, store: str, secret_file: Path, warm_up: bool = True
) -> list[str]:
    """``serve``'s arguments for one node: tiny Wan on one torch thread, its jobs in the
    database ``dsn`` shared with a lease of ``lease_s``, a checkpoint after every step,
    its URLs' outputs in ``store`` signed with the key in ``secret_file``."""
    args = ["--model", "tiny-wan", "--torch-threads", "1", "--checkpoint-every", "0"]
    args += ["--jobs-db", dsn, "--jobs-lease", f"{lease_s:g}"]
    args += ["--output-store", store, "--output-secret-file", str(secret_file)]
    return args if warm_up else [*args, "--no-warm-up"]


def job_row(dsn: str, job_id: str) -> dict[str, Any] | None:
    """The job's row in the database (``JOB_COLUMNS``); ``None`` if there is none."""
    import psycopg

    query = f"SELECT {', '.join(JOB_COLUMNS)} FROM video_jobs WHERE id = %s"
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as db:
        found = db.execute(query, (job_id,)).fetchone()
    return None if found is None else dict(zip(JOB_COLUMNS, found, strict=True))


def owner_pid(owner: str | None) -> int | None:
    """The process id in a server's owner id (``host:pid:token``); ``None`` for none."""
    if owner is None:
        return None
    return int(owner.rsplit(":", 2)[1])


def is_mp4(data: bytes) -> bool:
    """Whether ``data`` starts as an MP4 does (an ``ftyp`` box first)."""
    return len(data) > 8 and data[4:8] == b"ftyp"
