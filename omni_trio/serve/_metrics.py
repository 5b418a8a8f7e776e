"""Prometheus metrics of one server, in a registry of its own.

A per-app ``CollectorRegistry`` (never the global one), so several apps in one
process (tests, a multi-model server) never share or clash on series.

========================================  =========  ==========================================
series                                    kind       meaning
========================================  =========  ==========================================
omni_trio_requests_total{outcome}         counter    generation requests by outcome (below)
omni_trio_queue_wait_seconds              histogram  admission to the worker taking the request
omni_trio_execution_seconds               histogram  worker taking it to its last step (``exec_s``)
omni_trio_step_seconds                    histogram  a request's mean denoise step time
omni_trio_output_ready_wait_seconds       histogram  last step to output ready (decode, copy)
omni_trio_abort_latency_seconds           histogram  abort requested to the worker's release
omni_trio_requests_running                gauge      requests the worker holds now
omni_trio_requests_waiting                gauge      requests in the queue now (suspended included)
omni_trio_requests_suspended              gauge      waiting requests that were suspended (L61)
omni_trio_draining                        gauge      1 while shutting down
omni_trio_workers                         gauge      the engine's workers (one per device)
omni_trio_workers_alive                   gauge      workers whose threads have not died (L43)
omni_trio_engine_steps_total              counter    member-steps the engine ran
omni_trio_preemptions_total               counter    suspensions of running requests (L61)
omni_trio_steps_after_abort_total         counter    member-steps run after an abort was asked
omni_trio_cache_calls_total{decision}     counter    step-cached row-calls, computed or skipped
omni_trio_cache_blocks_total{decision}    counter    step-cached row-blocks, computed or skipped
omni_trio_cache_loosened_total            counter    requests whose threshold was loosened (L84)
omni_trio_video_jobs{status}              gauge      video jobs held now by status (L73)
omni_trio_video_bytes                     gauge      MP4 bytes the finished video jobs hold now
omni_trio_video_jobs_resumed_total        counter    video jobs run again after a restart or a
                                                     takeover (L77)
omni_trio_video_steps_lost_total          counter    steps those jobs had done and did again
omni_trio_prompt_cache_hits_total         counter    texts whose encoding the runners' prompt
                                                     caches held (L94)
omni_trio_prompt_cache_misses_total       counter    texts the text encoders encoded
omni_trio_prompt_cache_evictions_total    counter    encodings the caches' byte bound put out
omni_trio_prompt_cache_bytes              gauge      bytes the caches hold now
omni_trio_prompt_cache_encode_seconds     counter    the text encoders' seconds on misses
_total
omni_trio_prompt_cache_saved_seconds      counter    encoder seconds the hits saved (each hit:
_total                                               its entry's encode time)
omni_trio_result_cache_hits_total         counter    requests answered from the engine's result
                                                     cache (L95)
omni_trio_result_cache_misses_total       counter    seeded requests it could have answered and
                                                     did not
omni_trio_result_cache_kept_total         counter    outputs put in it
omni_trio_result_cache_evictions_total    counter    outputs its byte bound put out
omni_trio_result_cache_entries            gauge      outputs it holds now
omni_trio_result_cache_bytes              gauge      bytes it holds now (on disk: its files')
omni_trio_group_ranks{group}              gauge      the ranks of each parallel worker (L49)
omni_trio_group_calls_total{group,way}    counter    its model calls split by ``rows`` or ``tokens``
omni_trio_tenant_requests_total           counter    generation requests by tenant and outcome
{tenant,outcome}                                     (L56; the tenants below)
omni_trio_tenant_queue_wait_seconds       histogram  ``queue_wait_seconds`` by tenant
{tenant}
========================================  =========  ==========================================

Outcomes: ``completed``, ``disconnected`` (the client went away; aborted),
``shutdown`` (cut off by shutdown), ``deadline`` (aborted when its deadline passed),
``aborted``, ``failed`` (the model raised), and the refusals ``invalid`` (400),
``too_large`` (413), ``queue_full`` (429), ``deadline_refused`` (429: the deadline
cannot be met), ``unavailable`` (503), and with API keys (L55, L56) ``unauthorized``
(401, 403) and ``rate_limited`` (429: the tenant's requests per minute, or its
running video jobs).

The ``tenant`` label takes a bounded set of values: the tenants of the server's
keys (``set_tenants``), ``default`` for a request without one (an open server),
and ``other`` for any other name, so a client cannot make series. The routes run
every request as its key's tenant, so ``other`` counts the video jobs that run
again after a restart (L77) for a tenant the keys no longer name.

Next to them, the standard series every Prometheus client exports: ``process_*``
(CPU seconds, resident and virtual memory, open file descriptors, start time; on
Linux), ``python_info`` (the interpreter) and ``python_gc_*`` (collections per
generation). The ``*_created`` samples (each counter's and histogram's creation
time) are left out: in this text format each becomes a gauge series of its own,
one per counter label set and histogram, that nobody charts. They are dropped
when rendering, not by ``prometheus_client.disable_created_metrics()``, which would
change every registry of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .._outputs import EngineStatistics, RequestMetrics, RequestStatus
from .._reasons import AbortReason

if TYPE_CHECKING:
    from .._handle import RequestHandle

__all__ = ["DEFAULT_TENANT_LABEL", "OTHER_TENANT_LABEL", "OUTCOMES", "ServeMetrics"]

OUTCOMES = (
    "completed",
    "disconnected",
    "shutdown",
    "deadline",
    "aborted",
    "failed",
    "invalid",
    "too_large",
    "queue_full",
    "deadline_refused",
    "unavailable",
    "unauthorized",
    "rate_limited",
)

#: The ``tenant`` label of a request without a tenant, and of a tenant not named
#: by the server's keys.
DEFAULT_TENANT_LABEL = "default"
OTHER_TENANT_LABEL = "other"

# Bucket bounds, in seconds. Picked without measurement to span a tiny CPU model
# (milliseconds per step) to a large GPU model (seconds per step, minutes queued).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time."""

    def __init__(self, statistics: Callable[[], EngineStatistics | None]) -> None:
        self._statistics = statistics

    _COUNTERS = (
        (
            "omni_trio_engine_steps",
            "steps_run",
            "Member-steps the engine ran (one per request per step).",
        ),
        (
            "omni_trio_preemptions",
            "preemptions",
            "Suspensions of running requests at a step boundary.",
        ),
        (
            "omni_trio_steps_after_abort",
            "steps_after_abort",
            "Member-steps run for requests after their abort (or disconnect) was asked.",
        ),
    )

    def collect(self) -> Iterator[Metric]:
        stats = self._statistics()
        for name, field, documentation in self._COUNTERS:
            counter = CounterMetricFamily(name, documentation)
            counter.add_metric([], getattr(stats, field) if stats is not None else 0)
            yield counter

    def describe(self) -> Iterator[Metric]:
        for name, _, _ in self._COUNTERS:
            yield CounterMetricFamily(name, "")


class _VideoCollector:
    """Reads the video jobs' counts at scrape time (L73)."""

    def __init__(self, counts: Callable[[], Mapping[str, int]], held: Callable[[], int]) -> None:
        self._counts = counts
        self._held = held

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "omni_trio_video_jobs", "Video jobs held now, by status.", labels=["status"]
        )
        for status, count in self._counts().items():
            jobs.add_metric([status], count)
        yield jobs
        yield GaugeMetricFamily(
            "omni_trio_video_bytes",
            "MP4 bytes the finished video jobs hold now.",
            value=self._held(),
        )

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("omni_trio_video_jobs", "", labels=["status"])
        yield GaugeMetricFamily("omni_trio_video_bytes", "")


#: A series read from statistics objects' fields: its name, the field, its help.
_Series = tuple[str, str, str]


class _SummedCollector:
    """Reads counters and gauges at scrape time from statistics objects' fields, each
    summed over the objects ``read`` returns (none: zeros).

    The runners' prompt caches (L94, one object per runner) and the engine's result cache
    (L95, one object while an engine with one is open).
    """

    def __init__(
        self,
        read: Callable[[], Sequence[object]],
        counters: Sequence[_Series],
        gauges: Sequence[_Series],
    ) -> None:
        self._read = read
        self._counters = tuple(counters)
        self._gauges = tuple(gauges)

    def collect(self) -> Iterator[Metric]:
        read = self._read()
        for name, field, documentation in self._counters:
            counter = CounterMetricFamily(name, documentation)
            counter.add_metric([], sum(getattr(stats, field) for stats in read))
            yield counter
        for name, field, documentation in self._gauges:
            value = sum(getattr(stats, field) for stats in read)
            yield GaugeMetricFamily(name, documentation, value=value)

    def describe(self) -> Iterator[Metric]:
        for name, _, _ in self._counters:
            yield CounterMetricFamily(name, "")
        for name, _, _ in self._gauges:
            yield GaugeMetricFamily(name, "")


#: A runner's ``PromptCacheStatistics``, by field (serve imports no runner).
_PROMPT_CACHE_COUNTERS: tuple[_Series, ...] = (
    ("omni_trio_prompt_cache_hits", "hits", "Texts whose encoding a prompt cache held."),
    ("omni_trio_prompt_cache_misses", "misses", "Texts the text encoders encoded."),
    (
        "omni_trio_prompt_cache_evictions",
        "evictions",
        "Encodings the prompt caches' byte bound put out.",
    ),
    (
        "omni_trio_prompt_cache_encode_seconds",
        "encode_s",
        "Seconds the text encoders took on the prompt caches' misses.",
    ),
    (
        "omni_trio_prompt_cache_saved_seconds",
        "saved_s",
        "Text encoder seconds the prompt caches' hits saved.",
    ),
)
_PROMPT_CACHE_GAUGES: tuple[_Series, ...] = (
    (
        "omni_trio_prompt_cache_bytes",
        "bytes",
        "Bytes of text encodings the prompt caches hold now.",
    ),
)

#: The engine's ``ResultCacheStatistics``, by field.
_RESULT_CACHE_COUNTERS: tuple[_Series, ...] = (
    ("omni_trio_result_cache_hits", "hits", "Requests answered from the result cache."),
    (
        "omni_trio_result_cache_misses",
        "misses",
        "Seeded requests the result cache could have answered and did not.",
    ),
    ("omni_trio_result_cache_kept", "kept", "Outputs put in the result cache."),
    ("omni_trio_result_cache_evictions", "evicted", "Outputs the result cache's bound put out."),
)
_RESULT_CACHE_GAUGES: tuple[_Series, ...] = (
    ("omni_trio_result_cache_entries", "entries", "Outputs the result cache holds now."),
    ("omni_trio_result_cache_bytes", "bytes", "Bytes the result cache holds now."),
)


class _GroupCollector:
    """Reads each parallel worker's ranks and model calls each way at scrape time (L49).

    ``groups`` is ``(ranks, calls)`` per parallel worker, by its index among the
    engine's workers: ``calls`` returns rank 0's counts, which every rank of a sound
    group shares (no round trip to the other ranks).
    """

    def __init__(self, groups: Mapping[int, tuple[int, Callable[[], Mapping[str, int]]]]) -> None:
        self._groups = dict(groups)

    def collect(self) -> Iterator[Metric]:
        ranks = GaugeMetricFamily(
            "omni_trio_group_ranks", "The ranks of each parallel worker.", labels=["group"]
        )
        calls = CounterMetricFamily(
            "omni_trio_group_calls",
            "Model calls of each parallel worker, split by rows or by tokens.",
            labels=["group", "way"],
        )
        for index, (world, counts) in self._groups.items():
            ranks.add_metric([str(index)], world)
            for way, count in sorted(counts().items()):
                calls.add_metric([str(index), way], count)
        yield ranks
        yield calls

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("omni_trio_group_ranks", "", labels=["group"])
        yield CounterMetricFamily("omni_trio_group_calls", "", labels=["group", "way"])


class _WithoutCreated:
    """A registry's metrics, without their ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            created = metric.name + "_created"
            if any(sample.name == created for sample in metric.samples):
                kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                kept.samples = [sample for sample in metric.samples if sample.name != created]
                metric = kept
            yield metric


class ServeMetrics:
    """The server's metrics; ``render()`` gives the Prometheus text.

    Args:
        statistics: returns the engine's statistics now, or ``None`` while no
            engine is open.
        is_draining: returns whether the server is shutting down.
    """

    def __init__(
        self,
        statistics: Callable[[], EngineStatistics | None],
        is_draining: Callable[[], bool],
    ) -> None:
        self.registry = registry = CollectorRegistry()
        self._statistics = statistics
        self.requests = Counter(
            "omni_trio_requests",
            "Image generation requests by outcome.",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        self.queue_wait = Histogram(
            "omni_trio_queue_wait_seconds",
            "Time from admission to the worker taking the request.",
            buckets=_SLOW,
            registry=registry,
        )
        self.execution = Histogram(
            "omni_trio_execution_seconds",
            "Time from the worker taking the request to its last denoise step.",
            buckets=_SLOW,
            registry=registry,
        )
        self.step = Histogram(
            "omni_trio_step_seconds",
            "Mean denoise step time of a request.",
            buckets=_FAST,
            registry=registry,
        )
        self.output_ready = Histogram(
            "omni_trio_output_ready_wait_seconds",
            "Time from the last step to the output being ready (decode, copy).",
            buckets=_FAST,
            registry=registry,
        )
        # L84: what the requests' step caches did, summed when each ends.
        self.cache_calls = Counter(
            "omni_trio_cache_calls",
            "Row-calls of step-cached requests, computed (every block) or skipped.",
            ["decision"],
            registry=registry,
        )
        self.cache_blocks = Counter(
            "omni_trio_cache_blocks",
            "Row-blocks of step-cached requests, computed or skipped.",
            ["decision"],
            registry=registry,
        )
        for decision in ("computed", "skipped"):
            self.cache_calls.labels(decision=decision)
            self.cache_blocks.labels(decision=decision)
        # L77: jobs run again after a restart or a takeover, and the steps they redo.
        self.video_resumes = Counter(
            "omni_trio_video_jobs_resumed",
            "Video jobs run again after a restart or a takeover.",
            registry=registry,
        )
        self.video_steps_lost = Counter(
            "omni_trio_video_steps_lost",
            "Denoise steps that video jobs run again had done before.",
            registry=registry,
        )
        self.cache_loosened = Counter(
            "omni_trio_cache_loosened",
            "Requests whose step-cache threshold was loosened to meet their deadline.",
            registry=registry,
        )
        # L56: per tenant, with a bounded set of label values (``tenant_label``).
        self._tenants: frozenset[str] = frozenset()
        self.tenant_requests = Counter(
            "omni_trio_tenant_requests",
            "Generation requests by tenant and outcome.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.tenant_queue_wait = Histogram(
            "omni_trio_tenant_queue_wait_seconds",
            "Time from admission to the worker taking the request, by tenant.",
            ["tenant"],
            buckets=_SLOW,
            registry=registry,
        )
        self.abort_latency = Histogram(
            "omni_trio_abort_latency_seconds",
            "Time from an abort request to the worker releasing the request.",
            buckets=_FAST,
            registry=registry,
        )

        def stat(name: str) -> Callable[[], float]:
            def read() -> float:
                stats = statistics()
                return float(getattr(stats, name)) if stats is not None else 0.0

            return read

        Gauge(
            "omni_trio_requests_running", "Requests the worker holds now.", registry=registry
        ).set_function(stat("running"))
        Gauge(
            "omni_trio_requests_waiting", "Requests waiting in the queue now.", registry=registry
        ).set_function(stat("waiting"))
        Gauge(
            "omni_trio_requests_suspended",
            "Waiting requests that were suspended and hold parked state.",
            registry=registry,
        ).set_function(stat("suspended"))
        Gauge(
            "omni_trio_workers", "The engine's workers, one per device.", registry=registry
        ).set_function(lambda: float(len(stats.workers)) if (stats := statistics()) else 0.0)
        Gauge(
            "omni_trio_workers_alive",
            "Workers whose threads have not died; fewer than omni_trio_workers: degraded.",
            registry=registry,
        ).set_function(stat("workers_alive"))
        Gauge(
            "omni_trio_draining", "1 while the server shuts down, else 0.", registry=registry
        ).set_function(lambda: float(is_draining()))
        registry.register(_EngineCollector(statistics))
        # The standard process and Python series, in this registry only (the global
        # one has its own): each app's /metrics is complete on its own.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self._exposed = _WithoutCreated(registry)

    def add_video_jobs(
        self, counts: Callable[[], Mapping[str, int]], held: Callable[[], int]
    ) -> None:
        """Export the video jobs by status and the bytes they hold (read at scrape time)."""
        self.registry.register(_VideoCollector(counts, held))

    def video_resumed(self, steps_lost: int) -> None:
        """Count a video job run again (L77), which does ``steps_lost`` steps again."""
        self.video_resumes.inc()
        self.video_steps_lost.inc(steps_lost)

    def add_prompt_caches(self, runners: Iterable[object]) -> None:
        """Export the prompt caches of those of ``runners`` that have one (L94: a
        ``prompt_cache_statistics()``), summed, read at scrape time."""
        found = [
            read
            for runner in runners
            if callable(read := getattr(runner, "prompt_cache_statistics", None))
        ]
        if found:
            collector = _SummedCollector(
                lambda: [read() for read in found], _PROMPT_CACHE_COUNTERS, _PROMPT_CACHE_GAUGES
            )
            self.registry.register(collector)

    def add_result_cache(self) -> None:
        """Export what the engine's result cache did and holds (L95), read at scrape time."""
        statistics = self._statistics

        def read() -> list[object]:
            stats = statistics()
            return [] if stats is None or stats.result_cache is None else [stats.result_cache]

        self.registry.register(_SummedCollector(read, _RESULT_CACHE_COUNTERS, _RESULT_CACHE_GAUGES))

    def add_groups(self, groups: Mapping[int, tuple[int, Callable[[], Mapping[str, int]]]]) -> None:
        """Export each parallel worker's ranks and calls each way (``_GroupCollector``)."""
        self.registry.register(_GroupCollector(groups))

    def set_tenants(self, tenants: Iterable[str]) -> None:
        """Name the tenants that get a ``tenant`` label value of their own (the keys')."""
        self._tenants = frozenset(tenants)

    def tenant_label(self, tenant: str | None) -> str:
        """The ``tenant`` label of ``tenant``: its name if the keys name it (see above)."""
        if tenant is None:
            return DEFAULT_TENANT_LABEL
        return tenant if tenant in self._tenants else OTHER_TENANT_LABEL

    def count(self, outcome: str, tenant: str | None = None) -> None:
        """Count one request of ``tenant`` that ended with ``outcome``."""
        self.requests.labels(outcome=outcome).inc()
        self.tenant_requests.labels(tenant=self.tenant_label(tenant), outcome=outcome).inc()

    def account(self, handle: RequestHandle, *, gone: bool = False) -> str:
        """Count a terminal request's outcome and its timings; return the outcome.

        The outcome is ``disconnected`` if its client is ``gone``, else the
        handle's: ``completed``, ``failed``, ``shutdown`` or ``deadline`` for
        those abort reasons, else ``aborted``. Images, edits and video jobs all
        count through here.
        """
        status = handle.status
        if gone:
            outcome = "disconnected"
        elif status is RequestStatus.COMPLETED:
            outcome = "completed"
        elif status is RequestStatus.ABORTED:
            reason = handle.abort_reason
            stops = (AbortReason.SHUTDOWN, AbortReason.DEADLINE)
            outcome = str(reason) if reason in stops else "aborted"
        else:
            outcome = "failed"
        self.count(outcome, handle.tenant)
        if handle.metrics is not None:
            self.observe(handle.metrics)
            label = self.tenant_label(handle.tenant)
            self.tenant_queue_wait.labels(tenant=label).observe(handle.metrics.queue_wait_s)
        return outcome

    def observe(self, metrics: RequestMetrics) -> None:
        """Record a terminal request's timings, and what its step cache did."""
        self.queue_wait.observe(metrics.queue_wait_s)
        if metrics.steps_done > 0:
            self.execution.observe(metrics.exec_s)
            self.step.observe(metrics.exec_s / metrics.steps_done)
        if metrics.output_ready_wait_s > 0:
            self.output_ready.observe(metrics.output_ready_wait_s)
        if metrics.abort_latency_s is not None:
            self.abort_latency.observe(metrics.abort_latency_s)
        cache = metrics.cache
        if cache is not None:
            self.cache_calls.labels(decision="computed").inc(cache.calls_computed)
            self.cache_calls.labels(decision="skipped").inc(cache.calls_skipped)
            self.cache_blocks.labels(decision="computed").inc(cache.blocks_computed)
            self.cache_blocks.labels(decision="skipped").inc(cache.blocks_skipped)
            if cache.loosened:
                self.cache_loosened.inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST
