"""Helpers for the command-line tests: run ``python -m omni_trio``, read its one-line
errors, find a free (or a busy) port, follow the processes Ray starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a command run to its end may take.
BUDGET_S = 120


def python(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python <argv>`` on this checkout's code, in ``cwd``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
    )


def omni_trio_command(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m omni_trio <args>``."""
    return python("-m", "omni_trio", *args, cwd=cwd)


def bar_free(stderr: str) -> list[str]:
    """The pieces of ``stderr`` that are not the demo's progress bar."""
    pieces = stderr.replace("\r", "\n").splitlines()
    return [piece for piece in pieces if piece and not piece.startswith("  denoise:")]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m omni_trio serve ARGS`` to its end (it must stop by itself).

    No ``OMNI_TRIO_*`` variable of the test's own environment reaches it, only ``env``.
    """
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_TRIO_")}
    return subprocess.run(
        [sys.executable, "-m", "omni_trio", "serve", *args],
        capture_output=True,
        text=True,
        timeout=BUDGET_S,
        cwd=ROOT,
        env={**environ, **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int, text: str) -> None:
    """Assert that ``result`` exited ``status``, its stderr one error line holding ``text``."""
    assert result.returncode == status, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("omni-trio: error: ") and text in result.stderr, result.stderr


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def busy_port() -> Iterator[int]:
    """A port of 127.0.0.1 this process listens on for the block."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """The live (not zombie) processes below ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        children = {child for child, parent in parents.items() if parent in frontier}
        frontier = children - found
        found |= children
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left
