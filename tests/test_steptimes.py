"""A worker's step times by shape (``omni_trio._steptimes``), admission's lower bound (L4).

Pure: no threads, no clock; the durations are given.
"""

from __future__ import annotations

from omni_trio._steptimes import MAX_SHAPES, MIN_WARM, WINDOW, ShapeTime, StepTimes, lower_bound


def test_cold_steps_are_not_counted_and_a_shape_needs_two_warm_ones() -> None:
    """L4 (amended): a shape's first step is cold (a compile, an allocation): 60 s there
    counts for nothing; its figure comes after ``MIN_WARM`` warm steps."""
    times = StepTimes()
    times.measured([100], 60.0)
    for _ in range(MIN_WARM - 1):
        times.measured([100], 2.0)
    assert times.view() == ()
    times.measured([100], 3.0)
    assert times.view() == (ShapeTime(pixels=100, step_s=2.0, warm=MIN_WARM),)


def test_the_figure_is_the_fastest_of_the_last_window_and_a_batch_counts_per_member() -> None:
    """L4 (amended): a step of B members bounds one alone at elapsed / B; a spike in the
    window raises nothing; the window forgets old steps; a batch of two shapes counts for
    neither."""
    times = StepTimes()
    times.measured([100, 100], 9.0)  # cold
    times.measured([100, 100], 8.0)
    times.measured([100, 100, 100, 100], 12.0)
    assert times.view()[0].step_s == 3.0
    times.measured([100], 50.0)  # a spike
    assert times.view()[0].step_s == 3.0
    for _ in range(WINDOW):
        times.measured([100], 5.0)
    assert times.view()[0].step_s == 5.0
    times.measured([100, 200], 0.001)
    times.measured([200, 100], 0.001)
    times.measured([200, 100], 0.001)
    assert [shape.pixels for shape in times.view()] == [100]


def test_the_bound_reads_only_shapes_no_larger_than_the_request() -> None:
    """L4 (amended): a request of P pixels is bounded by the slowest shape of P pixels or
    fewer; with none, there is no bound (nothing is extrapolated)."""
    times = StepTimes()
    times.assume({100: 5.0, 400: 4.0, 1600: 40.0})
    shapes = times.view()
    assert lower_bound(shapes, 99) is None
    assert lower_bound(shapes, 100) == ShapeTime(pixels=100, step_s=5.0, warm=WINDOW)
    bound = lower_bound(shapes, 1599)
    assert bound is not None and (bound.pixels, bound.step_s) == (100, 5.0)
    bound = lower_bound(shapes, 10**9)
    assert bound is not None and (bound.pixels, bound.step_s) == (1600, 40.0)


def test_a_worker_keeps_a_bounded_number_of_shapes() -> None:
    """L4: a client cycling through sizes cannot grow a worker's table past ``MAX_SHAPES``;
    the least recently measured goes first."""
    times = StepTimes()
    for pixels in range(1, MAX_SHAPES + 2):
        for _ in range(MIN_WARM + 1):
            times.measured([pixels], 1.0)
    shapes = [shape.pixels for shape in times.view()]
    assert len(shapes) == MAX_SHAPES and shapes[0] == 2 and shapes[-1] == MAX_SHAPES + 1
