"""The load test's arithmetic, with no I/O: the Poisson schedule and the figures of a run.

Open loop: requests arrive as a Poisson process at ``rate`` per second for
``duration_s`` seconds, whatever the server answers, so a slow server faces a
growing queue instead of a politely waiting client. The arrival times come from a
seeded generator: the same seed and rate give the same schedule, on any server.
With ``count`` the window holds exactly that many arrivals, at the moments of a
Poisson process conditioned on that count (sorted uniform moments): the bursts of
a Poisson process without the run-to-run noise of its count, which in a short run
moves the offered load by tens of percent. With ``tenants`` (names and relative
rates) the same arrivals are split between them: each tenant gets its share of
them exactly (``tenant_counts``: largest remainders), and which arrivals are
whose is a seeded shuffle, so each tenant's arrivals are the moments of a Poisson
process conditioned on its count, at its share of the rate.

Every request ends one way (``OUTCOMES``): ``completed`` (a 200 with its
images), ``gave_up``, ``refused`` (any other status, kept per status and error
``code``) or ``error`` (no answer: a reset connection, a timeout, a body that
is not an images answer).
``summarize`` turns the records into the figures: the SLO goodput (images
received within ``slo_s`` of their request, per second of the arrival window),
the throughput (every image received, per second of the window), and the p50 and
p99 latencies of the completed requests, split by the priority sent
(``by_priority``) and per tenant (``by_tenant``, with each tenant's refusals by
code and its share of the completed requests); ``format_summary`` makes them the
command's table.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_CLASS",
    "OUTCOMES",
    "Arrival",
    "RequestRecord",
    "format_summary",
    "percentile",
    "poisson_schedule",
    "priority_class",
    "summarize",
    "tenant_counts",
]

#: How a request can end, in the order the table shows them.
OUTCOMES = ("completed", "gave_up", "refused", "error")


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    """One planned request.

    Args:
        index: its rank in the schedule, from 0.
        at_s: when it is sent, in seconds after the run's start.
        give_up_s: seconds after sending at which its client gives up, or
            ``None`` for a client that waits for the answer.
        priority: the ``priority`` its body carries, or ``None`` for none.
        tenant: the tenant that sends it, or ``None`` (a run without tenants).
    """

    index: int
    at_s: float
    give_up_s: float | None
    priority: int | None = None
    tenant: str | None = None


def tenant_counts(total: int, tenants: Sequence[tuple[str, float]]) -> dict[str, int]:
    """How many of ``total`` arrivals each tenant sends: its share by rate, exactly.

    Each tenant gets the whole part of ``total * rate / sum of rates``; the
    arrivals left go one each to the largest remainders (the earlier tenant on a
    tie), so the counts add up to ``total``, each within one of its exact share.

    Args:
        total: the arrivals to split.
        tenants: ``(name, rate)`` pairs, rates > 0, names distinct.
    """
    whole = sum(rate for _, rate in tenants)
    exact = [(name, total * rate / whole) for name, rate in tenants]
    counts = {name: math.floor(share) for name, share in exact}
    by_remainder = sorted(
        range(len(exact)), key=lambda i: exact[i][1] - counts[exact[i][0]], reverse=True
    )
    for i in by_remainder[: total - sum(counts.values())]:
        counts[exact[i][0]] += 1
    return counts


def poisson_schedule(
    *,
    rate: float,
    duration_s: float,
    seed: int,
    give_up_fraction: float = 0.0,
    give_up_s: tuple[float, float] = (0.0, 0.0),
    priority: int | None = None,
    priority_share: float = 1.0,
    count: int | None = None,
    tenants: Sequence[tuple[str, float]] = (),
) -> tuple[Arrival, ...]:
    """The arrivals of a Poisson process at ``rate`` per second within ``duration_s``.

    Each arrival draws three numbers in a fixed order (its gap, whether it gives
    up, when), so the arrival times depend on ``seed`` and ``rate`` alone: two
    runs with other give-up settings send at the same moments. Whether it sends
    ``priority`` is drawn from a second generator, also seeded by ``seed``, one
    number per arrival: the arrivals and give-ups are the same with or without
    priorities, and the n-th arrival's class depends on ``seed`` and
    ``priority_share`` alone. With ``count``, the ``count`` moments are drawn
    first (uniform in the window, then sorted), then each arrival's two give-up
    numbers. ``tenants`` split the arrivals after they are drawn (times,
    give-ups and priorities as without them): ``tenant_counts`` says how many
    each sends, and a third generator, seeded by ``seed``, shuffles who sends
    which.

    Args:
        rate: mean arrivals per second, > 0.
        duration_s: the arrival window in seconds; no arrival at or after it.
        seed: the generator's seed.
        give_up_fraction: the probability that an arrival's client gives up.
        give_up_s: the (low, high) span its give-up moment is drawn from, uniformly.
        priority: the ``priority`` the chosen share sends; ``None``: none does.
        priority_share: the probability that an arrival sends ``priority``.
        count: exactly this many arrivals (``rate`` is then not read), or
            ``None`` for a Poisson count.
        tenants: ``(name, rate)`` pairs: the tenants that share the arrivals by
            relative rate (``rate`` stays the total), or none.

    Returns:
        The arrivals, in time order.
    """
    rng = random.Random(seed)
    classes = random.Random(f"priority-{seed}")
    low, high = give_up_s

    def arrival(index: int, at: float) -> Arrival:
        gives_up = rng.random() < give_up_fraction
        after = rng.uniform(low, high)
        prioritized = priority is not None and classes.random() < priority_share
        return Arrival(
            index=index,
            at_s=at,
            give_up_s=after if gives_up else None,
            priority=priority if prioritized else None,
        )

    arrivals: list[Arrival] = []
    if count is not None:
        # random() is in [0, 1): every moment falls inside the window.
        moments = sorted(duration_s * rng.random() for _ in range(count))
        arrivals = [arrival(index, at) for index, at in enumerate(moments)]
    else:
        at = rng.expovariate(rate)
        while at < duration_s:
            arrivals.append(arrival(len(arrivals), at))
            at += rng.expovariate(rate)
    if not tenants:
        return tuple(arrivals)
    counts = tenant_counts(len(arrivals), tenants)
    senders = [name for name, _ in tenants for _ in range(counts[name])]
    random.Random(f"tenant-{seed}").shuffle(senders)
    return tuple(dataclasses.replace(a, tenant=t) for a, t in zip(arrivals, senders, strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """How one request went.

    Args:
        index: its arrival's index.
        sent_s: when it was sent, in seconds after the run's start.
        outcome: one of ``OUTCOMES``.
        latency_s: seconds from sending to the whole answer (``completed``,
            ``refused``), to giving up (``gave_up``) or to the failure (``error``).
        status: the HTTP status, when an answer came.
        give_up_s: when its client meant to give up (``Arrival.give_up_s``); one
            whose answer came first is ``completed`` all the same.
        status: the HTTP status, when an answer came.
        images: the images of a completed answer.
        error: what went wrong, for ``error``.
        priority: the ``priority`` its body carried (``Arrival.priority``).
        code: a refusal's error ``code`` (``{"error": {"code": ...}}``), if it had one.
        message: a refusal's error ``message`` (its first line), if it had one.
        tenant: the tenant that sent it (``Arrival.tenant``).
    """

    index: int
    sent_s: float
    outcome: str
    latency_s: float
    give_up_s: float | None = None
    status: int | None = None
    images: int = 0
    error: str | None = None
    priority: int | None = None
    code: str | None = None
    message: str | None = None
    tenant: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``, ``None`` for none.

    Linear between the two nearest ranks (numpy's default, and
    ``statistics.quantiles(..., method="inclusive")``): one value is every
    percentile of itself.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


#: ``by_priority``'s key for the requests that sent no ``priority``.
DEFAULT_CLASS = "default"


def priority_class(priority: int | None) -> str:
    """The ``by_priority`` key of a request that sent ``priority``."""
    return DEFAULT_CLASS if priority is None else str(priority)


def _rates(records: Sequence[RequestRecord], *, duration_s: float, slo_s: float) -> dict[str, Any]:
    """Goodput, throughput and latencies of ``records`` (one class, or all)."""
    completed = [r for r in records if r.outcome == "completed"]
    good = [r for r in completed if r.latency_s <= slo_s]
    latencies = [r.latency_s for r in completed]
    return {
        "requests": len(records),
        "completed": len(completed),
        "images": sum(r.images for r in completed),
        "good_images": sum(r.images for r in good),
        "good_requests": len(good),
        "goodput_per_s": sum(r.images for r in good) / duration_s,
        "throughput_per_s": sum(r.images for r in completed) / duration_s,
        "p50_latency_s": percentile(latencies, 50),
        "p99_latency_s": percentile(latencies, 99),
    }


def _reason(record: RequestRecord) -> str:
    """A refusal's ``refused_by_reason`` key: its status, and its code if it had one."""
    return f"{record.status} {record.code}" if record.code else str(record.status)


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float, slo_s: float
) -> dict[str, Any]:
    """The run's figures from its records; pure.

    Args:
        records: one per request sent.
        duration_s: the arrival window, the "second of the run" of the rates.
        slo_s: the latency objective: an image counts toward the goodput when
            its request completed within this many seconds of being sent.

    Returns:
        ``requests``; ``impatient`` (those whose client meant to give up);
        ``counts`` per outcome (every one of ``OUTCOMES``);
        ``refused_by_status`` (the status codes, as strings, and their counts);
        ``refused_by_reason`` (``"STATUS"`` or ``"STATUS CODE"`` with the
        answer's error code, e.g. ``"429 deadline_unmeetable"``, and counts);
        ``refusal_messages`` (per reason, the server's message of its first
        refusal that had one);
        ``images`` and ``good_images`` (within the SLO); ``good_requests``;
        ``goodput_per_s`` and ``throughput_per_s`` (images per second of the
        window); ``p50_latency_s`` and ``p99_latency_s`` of the completed
        requests (``None`` if none completed); ``by_priority``: per priority
        sent (``priority_class``: its number as a string, ``"default"`` for
        none), that class's ``requests``, ``completed``, images, goodput,
        throughput and latencies as above; ``by_tenant``: per tenant sent (none
        in a run without tenants), the same figures, its ``counts`` per outcome,
        its ``refused_by_reason`` and its ``share`` of the run's completed
        requests (0 to 1; 0 when none completed); ``duration_s`` and ``slo_s``.
    """
    counts = Counter(record.outcome for record in records)
    refused_records = [r for r in records if r.outcome == "refused"]
    refused = Counter(str(r.status) for r in refused_records)
    reasons = Counter(_reason(r) for r in refused_records)
    messages: dict[str, str] = {}
    for r in refused_records:
        if r.message is not None:
            messages.setdefault(_reason(r), r.message)
    classes: dict[str, list[RequestRecord]] = {}
    tenants: dict[str, list[RequestRecord]] = {}
    for record in records:
        classes.setdefault(priority_class(record.priority), []).append(record)
        if record.tenant is not None:
            tenants.setdefault(record.tenant, []).append(record)
    completed = counts["completed"]

    def tenant(members: Sequence[RequestRecord]) -> dict[str, Any]:
        figures = _rates(members, duration_s=duration_s, slo_s=slo_s)
        outcomes = Counter(r.outcome for r in members)
        why = Counter(_reason(r) for r in members if r.outcome == "refused")
        return {
            **figures,
            "counts": {outcome: outcomes[outcome] for outcome in OUTCOMES},
            "refused_by_reason": dict(sorted(why.items())),
            "share": figures["completed"] / completed if completed else 0.0,
        }

    return {
        **_rates(records, duration_s=duration_s, slo_s=slo_s),
        "impatient": sum(r.give_up_s is not None for r in records),
        "counts": {outcome: counts[outcome] for outcome in OUTCOMES},
        "refused_by_status": dict(sorted(refused.items())),
        "refused_by_reason": dict(sorted(reasons.items())),
        "refusal_messages": dict(sorted(messages.items())),
        "by_priority": {
            name: _rates(members, duration_s=duration_s, slo_s=slo_s)
            for name, members in sorted(classes.items())
        },
        "by_tenant": {name: tenant(members) for name, members in sorted(tenants.items())},
        "duration_s": duration_s,
        "slo_s": slo_s,
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The short table ``omni-trio load`` prints: outcomes, then the figures.

    Each kind of refusal has its line, and under it the server's message (of its
    first refusal). With more than one priority class (or any priority sent), a
    line per class follows: its goodput and p99 latency. With tenants, a line per
    tenant: its requests, completions (and share of them), p50 and p99 latency,
    and under it a line per kind of its refusals.
    """
    counts = summary["counts"]
    messages = summary["refusal_messages"]
    lines = ["outcome          requests"]
    for outcome in OUTCOMES:
        if outcome == "refused" and summary["refused_by_reason"]:
            for reason, count in summary["refused_by_reason"].items():
                lines.append(f"  {f'refused ({reason})':<16}{count:>7}")
                if reason in messages:
                    lines.append(f"    {messages[reason]}")
        else:
            lines.append(f"  {outcome:<16}{counts[outcome]:>7}")
    lines += [
        f"goodput          {summary['goodput_per_s']:.3f} images/s within"
        f" {summary['slo_s']:g} s ({summary['good_images']} images)",
        f"throughput       {summary['throughput_per_s']:.3f} images/s ({summary['images']} images)",
        f"latency p50      {_seconds(summary['p50_latency_s'])}",
        f"latency p99      {_seconds(summary['p99_latency_s'])}",
    ]
    classes = summary["by_priority"]
    if set(classes) - {DEFAULT_CLASS}:
        for name, figures in classes.items():
            label = "no priority" if name == DEFAULT_CLASS else f"priority {name}"
            lines.append(
                f"  {label:<15}{figures['goodput_per_s']:.3f} images/s goodput"
                f" ({figures['good_images']} of {figures['requests']} requests),"
                f" p99 {_seconds(figures['p99_latency_s'])}"
            )
    for name, figures in summary["by_tenant"].items():
        lines.append(
            f"  tenant {name}: {figures['requests']} requests, {figures['completed']} completed"
            f" ({figures['share']:.1%} of completed), p50 {_seconds(figures['p50_latency_s'])},"
            f" p99 {_seconds(figures['p99_latency_s'])}"
        )
        lines += [
            f"    {f'refused ({reason})':<30}{count:>7}"
            for reason, count in figures["refused_by_reason"].items()
        ]
    return "\n".join(lines) + "\n"
