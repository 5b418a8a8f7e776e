"""The jobs folder's files (L77): MP4s and checkpoints written atomically, the folder's
lock, the tidy at open, the test hook, the default folder.

Layout of ``--jobs-dir``::

    jobs.sqlite3 (+ -wal, -shm)   one row per job (``_sqlite``)
    videos/<id>.mp4               a completed job's MP4
    checkpoints/<id>.ckpt         a running job's last checkpoint (L78)
    lock                          the folder's lock (``flock``)

Files are written atomically: a temporary file in the same folder, ``fsync``,
``rename``, ``fsync`` of the folder, so a crash never leaves a half-written file under
its name. Opening a store removes what a crash may leave: temporary files, and files
whose job is gone (deleted, or never completed).

The folder's lock says who keeps it: one server's store holds it exclusively, so a
second server on the folder is refused; the servers that share it (L79) hold it
shared. It needs one host's file locks, which a network file system does not give.

A test hook, never set in production: ``OMNI_TRIO_TEST_HOLD=<point>`` makes the
process stop for good at one point (``admitted``: a job's row is written, before
its submit; ``checkpoint:<k>``: a checkpoint of step k or later is written;
``encode``: a job's output is there, before its MP4 is encoded; ``write``: an MP4's
temporary file is written, before its rename), after creating ``held-<point>`` in the
folder, so that a test kills the process at a known moment.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ._store import LIVE, JobRow, StoreBusyError

__all__ = [
    "HOLD_VARIABLE",
    "default_jobs_dir",
    "hold",
    "hold_folder",
    "read_checkpoint",
    "remove",
    "tidy",
    "write_atomically",
]

_log = logging.getLogger("omni_trio.serve")

#: The environment variable of the test hook (see the module's docstring).
HOLD_VARIABLE = "OMNI_TRIO_TEST_HOLD"


def default_jobs_dir() -> Path:
    """``$XDG_STATE_HOME/omni-trio/jobs``, else ``~/.local/state/omni-trio/jobs``."""
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state else Path.home() / ".local" / "state"
    return base / "omni-trio" / "jobs"


def hold(point: str, folder: Path) -> None:
    """The test hook: stop this thread for good at ``point`` if the variable names it."""
    if os.environ.get(HOLD_VARIABLE) != point:
        return
    (folder / f"held-{point.replace(':', '-')}").touch()
    _log.warning("held at %s for a test (%s)", point, HOLD_VARIABLE)
    threading.Event().wait()


def remove(path: Path) -> None:
    """Remove a file the store does not need; what cannot be removed is logged and left."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        _log.warning("the video jobs' store leaves %s: %s", path, exc.strerror or exc)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(
    path: Path, data: bytes, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync the folder.

    ``before_rename``: called once the temporary file is written (the test hook).
    """
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def read_checkpoint(path: Path, job_id: str) -> bytes | None:
    """The checkpoint at ``path``, or ``None``: none, or one that cannot be read (a
    directory, no permission), which is logged and refused as a corrupt one is (the job
    runs from step 0)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _log.warning(
            "video job %s: its checkpoint %s cannot be read (%s): it runs from step 0",
            job_id,
            path,
            exc.strerror or type(exc).__name__,
            extra={"request_id": job_id},
        )
        return None


def hold_folder(folder: Path, *, shared: bool) -> tuple[int, bool]:
    """Take the folder's lock: exclusive, or ``shared`` with the servers that share it.

    Returns:
        The lock's file descriptor (closing it lets go) and whether no other server had
        the folder open.

    Raises:
        StoreBusyError: another server holds it in the other way.
        OSError: the lock file cannot be made.
    """
    descriptor = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            if not shared:
                raise StoreBusyError(
                    f"another server keeps its video jobs in {folder}: give each"
                    " server its own --jobs-dir, or share the folder with --jobs-lease"
                    " SECONDS on every server (on one host)"
                ) from None
            alone = False
        if shared:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreBusyError(
                    f"a server that does not share it keeps its video jobs in"
                    f" {folder}: give this server another --jobs-dir, or start"
                    " both with --jobs-lease SECONDS"
                ) from None
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, alone


def tidy(folder: Path, rows: Iterable[JobRow]) -> None:
    """Remove temporary files, and files whose job is gone or not in that state."""
    rows = list(rows)
    completed = {row.id for row in rows if row.status == "completed"}
    live = {row.id for row in rows if row.status in LIVE}
    for files, keep, suffix in (
        (folder / "videos", completed, ".mp4"),
        (folder / "checkpoints", live, ".ckpt"),
    ):
        for path in files.iterdir():
            if path.suffix != suffix or path.stem not in keep:
                remove(path)
    for path in folder.glob("held-*"):
        remove(path)
