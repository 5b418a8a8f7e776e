"""What every benchmark shares: options, machine facts, statistics, memory, tables.

Resident memory (``rss_bytes``) is a benchmark's figure, never a test's: tests
assert exact things (live objects, tensors, threads) instead.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import statistics
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar, TypeVarTuple, Unpack

import anyio

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

__all__ = [
    "Options",
    "fmt",
    "live_tensor_count",
    "machine",
    "md_table",
    "p99",
    "rss_bytes",
    "shared_pipeline",
    "spread",
    "spread_p99",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The command line, as every benchmark sees it.

    Args:
        quick: a few seconds per benchmark (smoke tests); figures are noisier.
        kind: the tiny pipeline kind for the benchmarks on a real model.
        device: the torch device for ``pipeline``, ``batching`` and ``adapters``.
        requests: the burst size of ``batching``.
        backend: the event loop the engine runs on, ``"trio"`` or ``"asyncio"``.
    """

    quick: bool = False
    kind: str = "sd"
    device: str = "cpu"
    requests: int = 16
    backend: str = "trio"

    def run(self, func: Callable[[Unpack[Ts]], Awaitable[T]], *args: *Ts) -> T:
        """Run ``func(*args)`` in a fresh event loop of this backend."""
        return anyio.run(func, *args, backend=self.backend)


def machine() -> dict[str, Any]:
    """The facts that make a figure comparable: CPU, threads, versions."""
    import torch
    import trio

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": _cpu_model() or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "trio": trio.__version__,
        "anyio": importlib.metadata.version("anyio"),
        "diffusers": importlib.metadata.version("diffusers"),
        # Other work on a shared machine skews every figure; this says how much there was.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def p99(values: Sequence[float]) -> float:
    """The 99th percentile of ``values``: ``statistics.quantiles``, inclusive method
    (linear between the two nearest ranks, as numpy's default)."""
    if len(values) < 2:
        # quantiles() wants two values before Python 3.13; one value is its own p99.
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {
        "median": float(statistics.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def spread_p99(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and p99 of ``values``, and how many there are."""
    return {**spread(values), "p99": p99(values), "n": float(len(values))}


def live_tensor_count(*, where: Callable[[Any], bool] | None = None) -> int:
    """Count the torch tensors alive after a full collection, parameters excluded.

    With ``where``, count only tensors for which it holds.
    """
    import torch

    gc.collect()
    count = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read.
        kind = type(obj)
        tensor = issubclass(kind, torch.Tensor) and not issubclass(kind, torch.nn.Parameter)
        if tensor and (where is None or where(obj)):
            count += 1
    return count


def rss_bytes(*, trim: bool = False) -> int:
    """Return this process's resident set size in bytes.

    Reads ``/proc/self/statm`` (Linux); elsewhere falls back to the peak RSS from
    ``getrusage``, which only ever grows (so a growth check stays conservative).

    Args:
        trim: first hand the C allocator's free memory back to the system (glibc's
            ``malloc_trim``; a no-op elsewhere), so that the reading follows live
            memory rather than what the allocator happens to keep cached. Call
            ``gc.collect()`` before, too.
    """
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


@cache
def shared_pipeline(kind: str, device: str = "cpu") -> Any:
    """One tiny pipeline per kind and device for the whole run (building one takes seconds)."""
    from omni_trio.runners import tiny_pipeline

    return tiny_pipeline(kind).to(device)


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table: fixed digits, thousands separated; ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table; numeric-looking columns are right-aligned."""
    rows = [list(row) for row in rows]
    align = []
    for column in range(len(headers)):
        cells = [row[column] for row in rows]
        numeric = bool(cells) and all(_numeric(cell) for cell in cells)
        align.append("---:" if numeric else "---")
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _numeric(cell: str) -> bool:
    text = cell.replace(",", "").replace("%", "").replace("x", "").strip().lstrip("+-")
    try:
        float(text)
    except ValueError:
        return cell.strip() == "-"
    return True
