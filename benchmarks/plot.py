"""Plots with matplotlib's Agg backend, imported only when a plot is drawn.

matplotlib is an optional dependency (the ``bench`` extra): without it the
benchmarks still write their JSON and Markdown, and say that the plot was skipped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["PEER_COLORS", "bar_with_range", "figure", "save_plot"]

#: One colour per peer, the same in every plot.
PEER_COLORS = {
    "raw": "#7f7f7f",
    "naive": "#d62728",
    "interrupt": "#ff7f0e",
    "omni_trio": "#1f77b4",
}


@contextmanager
def figure(path: Path, *, columns: int = 1, title: str) -> Iterator[list[Any]]:
    """Yield ``columns`` axes of a new figure; save it to ``path`` as PNG on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=(5.2 * columns, 3.8), squeeze=False)
    try:
        yield list(axes[0])
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        fig.savefig(path, dpi=96)
    finally:
        plt.close(fig)


def save_plot(
    plot: Callable[[dict[str, Any], Path], None], result: dict[str, Any], path: Path
) -> bool:
    """Draw ``plot`` into ``path``; return whether it was drawn (matplotlib may be missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: {path.name} skipped", file=sys.stderr)
        return False
    plot(result, path)
    return True


def bar_with_range(
    ax: Any,
    labels: Sequence[str],
    spreads: Sequence[dict[str, float]],
    *,
    colors: Sequence[str] | None = None,
    ylabel: str,
    scale: float = 1.0,
) -> None:
    """Bars at the medians, with error bars from min to max."""
    medians = [s["median"] * scale for s in spreads]
    low = [(s["median"] - s["min"]) * scale for s in spreads]
    high = [(s["max"] - s["median"]) * scale for s in spreads]
    ax.bar(labels, medians, yerr=[low, high], capsize=4, color=colors)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
