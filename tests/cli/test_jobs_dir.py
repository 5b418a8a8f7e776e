"""``serve``'s video job store that cannot be had: one line before the server listens (L77).

Determinism: each case is a ``python -m omni_trio serve --model tiny-wan`` run to its end
(it stops by itself at the error); a busy folder is held by this test's own store (the
folder's lock, ``flock``) for the whole run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from omni_trio.serve.jobs import SqliteJobStore
from tests.support.cli import serve


def _refused(result: subprocess.CompletedProcess[str], text: str) -> None:
    """Exit 1, the last line the error naming ``text``, no traceback, nothing listened."""
    assert result.returncode == 1, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "omni-trio: error: " in last and text in last, result.stderr
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    for listening in ("Running on", "Uvicorn running", "Application startup"):
        assert listening not in result.stderr, result.stderr


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
def test_a_busy_jobs_folder_is_one_line_naming_jobs_lease_under_either_server(
    tmp_path: Path, server: str
) -> None:
    """L77 (amended), L79: a second server on a folder another holds says so in one line that
    names --jobs-lease, before it listens, under Hypercorn and Uvicorn alike."""
    holder = SqliteJobStore(tmp_path)
    holder.open()
    try:
        result = serve(
            "--model", "tiny-wan", "--port", "0", "--server", server, "--jobs-dir", str(tmp_path)
        )
    finally:
        holder.close()
    _refused(result, f"another server keeps its video jobs in {tmp_path}")
    assert "--jobs-lease" in result.stderr.splitlines()[-1]


def test_a_jobs_dir_that_is_a_file_or_a_corrupt_store_is_one_line(tmp_path: Path) -> None:
    """L4 (amended), L77: a --jobs-dir that is a file, and a jobs.sqlite3 that is not a
    database, each stop the start in one line naming the cause, before listening."""
    plain = tmp_path / "plain"
    plain.write_text("a file")
    _refused(
        serve("--model", "tiny-wan", "--port", "0", "--jobs-dir", str(plain)),
        f"the video jobs' folder {plain} cannot be used: File exists",
    )
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "jobs.sqlite3").write_bytes(b"not a database, " * 512)
    _refused(
        serve("--model", "tiny-wan", "--port", "0", "--jobs-dir", str(folder)),
        "jobs.sqlite3 cannot be read: file is not a database",
    )
