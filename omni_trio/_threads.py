"""The engine's threads as the process sees them: their names, and torch's thread count.

Every thread an engine starts is named ``omni-trio-<engine>`` (``.<worker>`` with
several workers) plus its role (``-worker``, ``-materializer``), so a test, a
server's shutdown check or a debugger finds them by name (L35).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from ._log import ENGINE

if TYPE_CHECKING:
    from ._config import EngineConfig

__all__ = ["ENGINE_THREAD_PREFIX", "engine_threads", "set_torch_threads", "worker_name"]

#: Every thread an engine starts has a name that begins with this.
ENGINE_THREAD_PREFIX = "omni-trio-"


def worker_name(engine: int, index: int, *, several: bool) -> str:
    """The name of engine ``engine``'s worker ``index``, which its threads' names extend."""
    return f"{ENGINE_THREAD_PREFIX}{engine}" + (f".{index}" if several else "")


def engine_threads() -> list[threading.Thread]:
    """Return the live threads that some engine started."""
    return [t for t in threading.enumerate() if t.name.startswith(ENGINE_THREAD_PREFIX)]


def set_torch_threads(config: EngineConfig, workers: int) -> None:
    """Pick the process's torch intra-op thread count for ``workers`` workers.

    The count is process-wide (``torch.set_num_threads``: the last call wins), so
    it is one setting for all workers: ``config.torch_threads`` when given, else,
    with several workers, the CPU cores divided among them, so that CPU workers do
    not oversubscribe the cores. With one worker and no setting it is left alone.
    """
    threads = config.torch_threads
    if threads is None:
        if workers == 1:
            return
        threads = max(1, _cores() // workers)
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        ENGINE.info("torch intra-op threads set to %d for %d worker(s)", threads, workers)


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
