"""What every benchmark shares: machine facts, statistics, output."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["machine", "percentile", "spread", "write_result"]


def machine() -> dict[str, Any]:
    """The facts that make a figure comparable: CPU, threads, versions."""
    import torch
    import trio

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "trio": trio.__version__,
        "anyio": importlib.metadata.version("anyio"),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of ``values``."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_result(name: str, result: dict[str, Any], out: Path | None) -> None:
    """Print ``result`` as JSON and write it to ``out/NAME.json`` when given."""
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(text + "\n")
