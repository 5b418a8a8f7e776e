"""The rank processes: spawned with a parent-death signal, watched, and reaped (L41, L49).

Ranks 1..N-1 are processes of the ``spawn`` start method (a fresh interpreter: a
fork of the engine's process, with its threads and OpenMP pool, can deadlock).
Each child's first act is ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills
it when its parent dies, however the parent dies. The signal follows the
*thread* that forked the child, not the process, so the children are forked from
a thread of the runner's own (the keeper), which lives exactly as long as the
runner: a runner built in a short-lived thread (a thread pool's) would otherwise
lose its ranks when that thread ends. A child whose parent died before the signal
was set exits at once. Every child is also a daemon (multiprocessing ends it at
interpreter exit) and reads its control pipe, whose end of file (the parent gone)
ends it too.

``reap`` ends them all: each gets ``grace`` seconds to exit by itself, then
SIGKILL; each is joined, so none is left, not even a zombie.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankProcesses", "receive", "set_parent_death_signal"]

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent (``parent``) dies (Linux).

    Elsewhere this does nothing: the control pipe's end of file still ends a
    rank whose parent is gone, at its next read.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:
        # The parent died before the signal was set: nobody will send it.
        os._exit(1)


class RankProcesses:
    """Ranks 1..N-1 of one group, forked from a keeper thread that lives until ``reap``.

    Args:
        context: a ``multiprocessing`` context of the ``spawn`` method.
        target: each child's entry point (a module-level function).
        args: each child's arguments, rank 1 first.
        name: the keeper thread's name (and the children's, with their rank).
    """

    def __init__(
        self,
        context: Any,
        target: Callable[..., object],
        args: Sequence[tuple[Any, ...]],
        *,
        name: str,
    ) -> None:
        self._processes = [
            context.Process(target=target, args=arg, name=f"{name}-rank{rank}", daemon=True)
            for rank, arg in enumerate(args, start=1)
        ]
        self._pids: tuple[int, ...] = ()
        self._codes: list[int | None] | None = None
        self._started = threading.Event()
        self._release = threading.Event()
        self._error: BaseException | None = None
        self._keeper = threading.Thread(target=self._keep, name=f"{name}-keeper", daemon=True)

    def _keep(self) -> None:
        try:
            for process in self._processes:
                process.start()
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()
        # The children's parent-death signal is this thread's end: wait for reap().
        self._release.wait()

    def start(self) -> None:
        """Fork every child (from the keeper thread); return once they are forked.

        Raises:
            BaseException: whatever forking raised (the children forked are reaped).
        """
        self._keeper.start()
        self._started.wait()
        self._pids = tuple(process.pid or 0 for process in self._processes)
        if self._error is not None:
            error, self._error = self._error, None
            self.reap(grace=0)
            raise error

    @property
    def pids(self) -> tuple[int, ...]:
        """The children's process ids, rank 1 first (0 for one not started)."""
        return self._pids

    def exit_codes(self) -> list[int | None]:
        """Each child's exit code (``None`` while it runs; ``-n``: signal ``n``)."""
        if self._codes is not None:
            return list(self._codes)
        return [process.exitcode for process in self._processes]

    def sentinels(self) -> list[int]:
        """What ``multiprocessing.connection.wait`` sees ready when a child ends."""
        if self._codes is not None:
            return []
        return [process.sentinel for process in self._processes if process.pid is not None]

    def wait_exit(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for any child to end, and reap those that did.

        For a failure's message: which peer ended, and how.
        """
        if self._codes is not None:
            return
        running = [p for p in self._processes if p.pid is not None and p.exitcode is None]
        if not running:
            return
        ended = set(wait([process.sentinel for process in running], timeout))
        for process in running:
            if process.sentinel in ended:
                # Its pipe closed as it exited; the join waits out the rest of its exit.
                process.join(1.0)

    def reap(self, *, grace: float) -> None:
        """End every child: ``grace`` seconds to exit, then SIGKILL; join them, then the keeper.

        Idempotent.
        """
        if self._codes is None:
            deadline = time.monotonic() + grace
            started = [process for process in self._processes if process.pid is not None]
            for process in started:
                process.join(max(0.0, deadline - time.monotonic()))
            for process in started:
                if process.exitcode is None:
                    process.kill()
            for process in started:
                process.join()
            self._codes = [process.exitcode for process in self._processes]
            for process in started:
                process.close()
        self._release.set()
        if self._keeper.ident is not None:
            self._keeper.join()


def receive(connection: Connection, timeout: float | None) -> object:
    """The next message on ``connection`` within ``timeout`` seconds.

    Raises:
        TimeoutError: none came.
        EOFError: the other end is closed.
    """
    if not connection.poll(timeout):
        raise TimeoutError
    return connection.recv()
