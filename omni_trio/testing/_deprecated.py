"""Names of ``omni_trio.testing`` on their way out, each with the version that removes it."""

from __future__ import annotations

import os
import warnings

__all__ = ["rss_bytes"]


def rss_bytes(*, trim: bool = False) -> int:
    """Return this process's resident set size in bytes (deprecated: removed in 0.3.0).

    A benchmark's figure, not a test's; the benchmarks have their own
    (``benchmarks/common.py`` in a checkout). Reads ``/proc/self/statm`` (Linux);
    elsewhere the peak RSS from ``getrusage``.

    Args:
        trim: first hand the C allocator's free memory back to the system (glibc's
            ``malloc_trim``; a no-op elsewhere).
    """
    warnings.warn(
        "omni_trio.testing.rss_bytes is deprecated and will be removed in 0.3.0: tests"
        " assert live objects, tensors and threads, never resident memory",
        DeprecationWarning,
        stacklevel=2,
    )
    if trim:
        _malloc_trim()
    try:
        with open("/proc/self/statm", "rb") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux and the BSDs report KiB, macOS bytes.
        return peak if os.uname().sysname == "Darwin" else peak * 1024
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> None:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
