"""A value a thread holds for the length of a block: the runners' per-call contexts.

The adapters' call context and the step cache's shared sums are thread-locals that a
model call sets around itself; nested blocks restore each other's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["thread_value"]


@contextmanager
def thread_value(local: threading.local, name: str, value: Any) -> Iterator[None]:
    """Inside, ``local.<name>`` is ``value`` in this thread; after, what it was (``None``
    if unset)."""
    saved = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, saved)
