"""The engine's side of step caching (L84): loosening under deadline pressure, the metrics.

The cache itself is the runner's (``RunnerCapabilities.step_cache``); the engine
only does two things with it, both from its own threads:

- at a step boundary, the worker loosens the threshold of a request whose deadline
  is at risk and whose policy allows it (``max_threshold``): the estimate is the
  request's steps left times the worker's measured step time, against the time
  left on the perf_counter clock. One stage per boundary, at most
  ``LOOSEN_STAGES`` in all, evenly from ``threshold`` to ``max_threshold``, so a
  request at risk reaches the bound in ``LOOSEN_STAGES`` boundaries and a
  mis-estimate costs a bounded loss of quality, never an unbounded one;
- just before a request's state is discarded, whatever ended it, the engine reads
  what its cache did (``cache_metrics``), for ``RequestMetrics.cache``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ._errors import InvalidOutputError
from ._runner import Runner, StepCacheRunner
from ._stepcache import CacheMetrics

if TYPE_CHECKING:
    from ._workitem import WorkItem

__all__ = ["LOOSEN_STAGES", "loosen_at_risk", "loosened_threshold", "read_cache_metrics"]

#: Stages from a policy's ``threshold`` to its ``max_threshold`` (picked, not measured:
#: four steps of a quarter each reach the bound within four boundaries).
LOOSEN_STAGES = 4


def loosened_threshold(threshold: float, max_threshold: float, stage: int) -> float:
    """The threshold after ``stage`` of ``LOOSEN_STAGES`` stages (the bound at the last)."""
    if stage >= LOOSEN_STAGES:
        return max_threshold
    return threshold + (max_threshold - threshold) * stage / LOOSEN_STAGES


def loosen_at_risk(
    runner: Runner[Any], running: Sequence[WorkItem], step_s: float | None
) -> list[tuple[WorkItem, Exception]]:
    """Loosen, by one stage, each running request whose deadline is at risk (L84).

    At risk: its steps left times ``step_s`` (the worker's measured step time) exceed
    the time left before its deadline. Only for a first-block policy with a
    ``max_threshold`` above its ``threshold``, fewer than ``LOOSEN_STAGES`` stages
    loosened so far, and a measured step time. Returns the requests whose runner
    call raised, with the exception, for the worker to fail.
    """
    if step_s is None:
        return []
    now = time.perf_counter()
    failed: list[tuple[WorkItem, Exception]] = []
    for item in running:
        policy = item.request.cache
        deadline = item.t_deadline
        if policy is None or policy.max_threshold is None or deadline is None:
            continue
        assert policy.threshold is not None  # a first-block policy: max_threshold is its
        if item.cache_stage >= LOOSEN_STAGES or policy.max_threshold <= policy.threshold:
            continue
        if (item.steps_total - item.steps_done) * step_s <= deadline - now:
            continue
        item.cache_stage += 1
        threshold = loosened_threshold(policy.threshold, policy.max_threshold, item.cache_stage)
        try:
            cast("StepCacheRunner[Any]", runner).set_cache_threshold(item.state, threshold)
        except Exception as exc:
            failed.append((item, exc))
    return failed


def read_cache_metrics(runner: Runner[Any], item: WorkItem, state: object) -> Exception | None:
    """Keep what ``state``'s step cache did on ``item``; return the runner's error, if any."""
    policy = item.request.cache
    if policy is None or not policy.skips or not runner.capabilities.step_cache:
        return None
    try:
        metrics = cast("StepCacheRunner[Any]", runner).cache_metrics(state)
    except Exception as exc:
        return exc
    if metrics is not None and not isinstance(metrics, CacheMetrics):
        kind = type(metrics).__name__
        return InvalidOutputError(f"the runner's cache_metrics returned {kind}, not CacheMetrics")
    item.cache_metrics = metrics
    return None
