"""One lock per shared component (L42): runners over one pipeline share its components,
and some are not safe in two threads at once (a VAE's encode and decode with the flags
and dtype a call sets on it, a tokenizer's call, which sets its padding on itself). Every
runner holds ``object_lock(component)`` around such a use: one lock per object, whatever
runners or pipelines share it, reentrant (a call inside may take it again), dropped with
the object.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["object_lock"]

_locks_lock = threading.Lock()
_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
#: The lock of an object that cannot be weakly held (no model or tokenizer of ours).
_unkeyed = threading.RLock()


def object_lock(component: Any) -> threading.RLock:
    """The lock every runner holds while it uses ``component`` (one per object)."""
    with _locks_lock:
        try:
            lock = _locks.get(component)
            if lock is None:
                lock = _locks[component] = threading.RLock()
        except TypeError:
            return _unkeyed
        return lock
