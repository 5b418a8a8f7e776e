"""What a worker measured of its steps, by shape, for admission's step-time bound (L4).

A step is left only at its end or at a cancel point, so a request whose one step
alone would outlast ``EngineConfig.max_step_s`` could hold its worker past any
abort, deadline or shutdown: ``submit`` refuses it. The figure must never turn away
a request whose step is short, so it is a lower bound, read only from warm steps of
shapes no larger than the request's:

- a shape is a request's ``step_pixels`` (``num_images x height x width x
  max(1, num_frames)``); a batch step counts for its shape when all its members have
  that shape;
- the first ``COLD_STEPS`` steps of a shape on a worker are cold (allocations,
  autotuning, a compile) and are not counted;
- a step of ``B`` members takes at most ``B`` times one of them alone (batching only
  saves), so ``elapsed / B`` bounds one member's step alone from below;
- of a shape's last ``WINDOW`` warm steps, the fastest is its figure: a load spike
  or a recompile among them raises nothing;
- a request of ``P`` pixels takes at least the figure of any shape of ``P`` pixels
  or fewer measured warm ``MIN_WARM`` times or more: a step does not get faster with
  more pixels. A request larger than every shape measured is admitted: its own first
  steps measure it. Nothing is extrapolated from a smaller shape's cost per pixel (a
  tiny step's fixed costs would make a large one look 50 times slower than it is).

Pure and synchronous: the worker's thread writes, admission reads the frozen
``ShapeTime`` tuple the worker publishes with its batch (``RunningBatch``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["COLD_STEPS", "MIN_WARM", "WINDOW", "ShapeTime", "StepTimes", "lower_bound"]

#: Steps of a shape that are not counted: its first on a worker (not measured: one
#: is what a first allocation or a compile takes; more would only delay the bound).
COLD_STEPS = 1
#: Warm steps of a shape before its figure bounds anything.
MIN_WARM = 2
#: Warm steps of a shape kept; the fastest of them is its figure.
WINDOW = 8
#: Shapes a worker keeps figures of, the least recently measured dropped first
#: (a server sees a handful of sizes; a client cycling through sizes is bounded).
MAX_SHAPES = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeTime:
    """A worker's figure for one shape: a step of a request of ``pixels`` alone takes at
    least ``step_s`` seconds, by the fastest of its last ``warm`` warm steps (at most
    ``WINDOW``)."""

    pixels: int
    step_s: float
    warm: int


class _Shape:
    __slots__ = ("figure", "seen", "warm")

    def __init__(self) -> None:
        self.seen = 0
        self.warm: deque[float] = deque(maxlen=WINDOW)
        self.figure: float | None = None


class StepTimes:
    """One worker's figures by shape; written by its thread only."""

    __slots__ = ("_shapes", "_view")

    def __init__(self) -> None:
        self._shapes: OrderedDict[int, _Shape] = OrderedDict()
        self._view: tuple[ShapeTime, ...] = ()

    def view(self) -> tuple[ShapeTime, ...]:
        """The shapes measured warm ``MIN_WARM`` times or more, by pixels (one tuple,
        rebuilt only when a figure changes)."""
        return self._view

    def measured(self, pixels: Sequence[int], elapsed: float) -> None:
        """One batch step of members of ``pixels`` each took ``elapsed`` seconds."""
        first = pixels[0]
        for other in pixels:
            if other != first:
                return  # members of several shapes: no shape's figure
        shape = self._shapes.get(first)
        if shape is None:
            shape = self._shapes[first] = _Shape()
            if len(self._shapes) > MAX_SHAPES:
                self._shapes.popitem(last=False)
                self._rebuild()
        else:
            self._shapes.move_to_end(first)
        shape.seen += 1
        if shape.seen <= COLD_STEPS:
            return
        shape.warm.append(elapsed / len(pixels))
        figure = min(shape.warm) if len(shape.warm) >= MIN_WARM else None
        if figure != shape.figure:
            shape.figure = figure
            self._rebuild()

    def assume(self, figures: Mapping[int, float]) -> None:
        """Read ``figures`` (pixels to seconds) as warm figures, measured ``WINDOW`` times;
        every other shape forgotten (``omni_trio.testing.assume_step_time``)."""
        self._shapes.clear()
        for pixels, seconds in figures.items():
            shape = self._shapes[pixels] = _Shape()
            shape.seen = COLD_STEPS + WINDOW
            shape.warm.extend([seconds] * WINDOW)
            shape.figure = seconds
        self._rebuild()

    def _rebuild(self) -> None:
        self._view = tuple(
            ShapeTime(pixels=pixels, step_s=shape.figure, warm=len(shape.warm))
            for pixels, shape in sorted(self._shapes.items())
            if shape.figure is not None
        )


def lower_bound(shapes: Sequence[ShapeTime], pixels: int) -> ShapeTime | None:
    """The figure that bounds a step of ``pixels`` from below: the slowest of the shapes
    of ``pixels`` or fewer; ``None`` if none was measured."""
    bound: ShapeTime | None = None
    for shape in shapes:
        if shape.pixels > pixels:
            break  # sorted by pixels
        if bound is None or shape.step_s > bound.step_s:
            bound = shape
    return bound
