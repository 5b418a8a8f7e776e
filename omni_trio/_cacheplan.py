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

The same read, by the same reader (``read_cache_metrics``), takes what the runner's
prompt-embedding cache did for the request's texts (L94: ``prompt_cache_metrics``, a
call a runner may leave out), for ``RequestMetrics.prompt_cache``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ._errors import InvalidOutputError
from ._runner import Runner, StepCacheRunner
from ._stepcache import CacheMetrics, PromptCacheMetrics

if TYPE_CHECKING:
    from ._workitem import WorkItem

__all__ = ["LOOSEN_STAGES", "loosen_at_risk", "loosened_threshold", "read_cache_metrics"]

#: Stages from a policy's ``threshold`` to its ``max_threshold`` (picked, not measured:
#: four steps of a quarter each reach the bound within four boundaries).
LOOSEN_STAGES = 4

M = TypeVar("M", CacheMetrics, PromptCacheMetrics)


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
    """Keep what ``state``'s caches did on ``item``; return the runner's first error, if any.

    The step cache's (L84) for a request whose policy skips, on a runner that declares
    ``step_cache``; the prompt cache's (L94) from a runner that has the call. Each read
    stands alone: one that raises leaves the other's figures.
    """
    error = None
    policy = item.request.cache
    if policy is not None and policy.skips and runner.capabilities.step_cache:
        item.cache_metrics, error = _read(runner, "cache_metrics", state, CacheMetrics)
    item.prompt_cache, prompt_error = _read(
        runner, "prompt_cache_metrics", state, PromptCacheMetrics, optional=True
    )
    # "is None", not "or": an exception's __bool__ is the runner's code.
    return prompt_error if error is None else error


def _read(
    runner: Runner[Any], call: str, state: object, kind: type[M], *, optional: bool = False
) -> tuple[M | None, Exception | None]:
    """What the runner's ``call(state)`` returned, or its error.

    ``optional``: a runner without the call reports nothing (``None``); otherwise its
    absence is the error. A value neither ``None`` nor a ``kind`` is an
    ``InvalidOutputError``.
    """
    if optional and not hasattr(runner, call):
        return None, None
    try:
        metrics = getattr(runner, call)(state)
    except Exception as exc:
        return None, exc
    if metrics is not None and not isinstance(metrics, kind):
        found = type(metrics).__name__
        return None, InvalidOutputError(
            f"the runner's {call} returned {found}, not {kind.__name__}"
        )
    return metrics, None
