"""A real PostgreSQL server for the video jobs' PostgreSQL store (L98): ``postgres``.

The session-scoped fixture ``postgres`` starts one server from the binaries of Debian's
``postgresql`` package (``/usr/lib/postgresql/<version>/bin``, else ``initdb`` on the
``PATH``) in a temporary folder: its data, its log and its Unix sockets, listening on
127.0.0.1 on a free port, trusting local connections, with ``fsync`` off (a test's data
need not survive a power cut; a restart is a clean one). initdb and postgres refuse to
run as root: as root they run as the ``postgres`` user (``runuser``), made if missing,
and the folder is its own. The server is stopped at the end of the session, and on any
failure; it is skipped, with the reason, only where the binaries are not installed (CI
installs them: .ci/run).

Each test takes a database of its own (``PostgresServer.database``): the stores' tables,
sequences and advisory locks are a database's, so no test sees another's jobs.

The fixture is one server per process however many modules import it: the modules that
use it are one ``worker_group`` (tests/conftest.py), so ``pytest -n`` starts it once.
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.cli import free_port

__all__ = ["PostgresServer", "bin_folder", "postgres"]

#: Seconds a ``pg_ctl`` command (start, restart, stop) may take.
PG_CTL_S = 60


def bin_folder() -> Path | None:
    """The folder of PostgreSQL's server binaries (the newest installed), or ``None``."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return None if initdb is None else Path(initdb).parent


def _version(path: str) -> tuple[int, ...]:
    version = Path(path).parent.parent.name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


@dataclass(kw_only=True)
class PostgresServer:
    """One PostgreSQL server of the tests, running in ``folder``.

    Args:
        bin: the folder of its binaries.
        folder: its temporary folder: ``data/``, ``log`` and its Unix sockets.
        port: the TCP port it listens on, on 127.0.0.1.
        user: the operating system user it runs as (``None``: this process's).
    """

    bin: Path
    folder: Path
    port: int
    user: str | None
    started_s: float = 0.0  # how long its start took, initdb included
    _names: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def dsn(self, dbname: str = "postgres") -> str:
        """A connection string to ``dbname`` as its superuser, over TCP."""
        return f"host={self.host} port={self.port} user=postgres dbname={dbname}"

    def database(self) -> str:
        """A new, empty database; its connection string."""
        import psycopg

        with self._lock:
            name = f"test_{next(self._names)}"
        with psycopg.connect(self.dsn(), autocommit=True) as db:
            db.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=PG_CTL_S, cwd=self.folder
        )

    def _pg_ctl(self, *argv: str) -> None:
        done = self._run("pg_ctl", "-D", str(self.folder / "data"), "-w", "-t", "30", *argv)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctl {argv[0]} failed: {done.stderr.strip()}\n{self.log()}")

    def log(self) -> str:
        """The tail of the server's log."""
        try:
            return (self.folder / "log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def start(self) -> None:
        """initdb, then start the server and wait until it accepts connections."""
        started = time.perf_counter()
        done = self._run(
            "initdb",
            "-D",
            str(self.folder / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--encoding=UTF8",
            "--locale=C",
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.strip()}")
        self._start()
        self.started_s = time.perf_counter() - started

    def _start(self) -> None:
        settings = (
            f"-c listen_addresses={self.host} -c port={self.port}"
            f" -c unix_socket_directories={self.folder} -c fsync=off"
            " -c full_page_writes=off -c max_connections=200"
        )
        self._pg_ctl("-l", str(self.folder / "log"), "-o", settings, "start")

    def restart(self) -> None:
        """Restart the server (``pg_ctl restart``, fast mode: every connection is cut)."""
        self._pg_ctl("-l", str(self.folder / "log"), "-m", "fast", "restart")

    @contextmanager
    def down(self) -> Iterator[None]:
        """Stop the server (fast mode) for the block, then start it again."""
        self._pg_ctl("-m", "fast", "stop")
        try:
            yield
        finally:
            self._start()

    def stop(self) -> None:
        """Stop the server (immediate mode) and remove its folder (idempotent)."""
        if (self.folder / "data" / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)


def _runs_as() -> str | None:
    """The user the server runs as: ``postgres`` (made if missing) for root, else ``None``."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "postgres"], check=True, timeout=60
        )
    return "postgres"


def start_server() -> PostgresServer:
    """A PostgreSQL server started in a new temporary folder; stopped on any failure.

    Raises:
        RuntimeError: initdb or pg_ctl failed (the message has the server's log).
    """
    found = bin_folder()
    assert found is not None, "bin_folder() first"
    user = _runs_as()
    folder = Path(tempfile.mkdtemp(prefix="omni-trio-pg-"))
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(folder, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(bin=found, folder=folder, port=free_port(), user=user)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


class _Shared:
    """The one server of this process, started by the first fixture that asks for it,
    stopped when the last lets go (each module that imports the fixture has its own)."""

    def __init__(self) -> None:
        self.server: PostgresServer | None = None
        self.users = 0

    def acquire(self) -> PostgresServer:
        if self.server is None:
            self.server = start_server()
            atexit.register(self.server.stop)  # an interrupted session stops it too
        self.users += 1
        return self.server

    def release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.server is not None:
            self.server.stop()
            self.server = None


_SHARED = _Shared()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the session (skipped where its binaries are missing)."""
    if bin_folder() is None:
        pytest.skip(
            "PostgreSQL's server binaries (initdb, pg_ctl) are not installed:"
            " apt-get install postgresql"
        )
    server = _SHARED.acquire()
    try:
        yield server
    finally:
        _SHARED.release()
