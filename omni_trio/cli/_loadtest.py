"""``omni-trio load URL``: an open-loop load test of an OpenAI-style images endpoint.

Open loop: requests arrive as a Poisson process at ``rate`` per second for
``duration_s`` seconds, whatever the server answers, so a slow server faces a
growing queue instead of a politely waiting client. The arrival times come from a
seeded generator: the same seed and rate give the same schedule, on any server.
With ``count`` the window holds exactly that many arrivals, at the moments of a
Poisson process conditioned on that count (sorted uniform moments): the bursts of
a Poisson process without the run-to-run noise of its count, which in a short run
moves the offered load by tens of percent.

Each arrival is a client of its own: it opens a connection (no keep-alive, so no
client waits for another's connection), POSTs a small generation body and waits
for the answer. A ``give_up_fraction`` of them are impatient: each gives up at a
moment drawn uniformly from ``give_up_s`` (seconds after it sent its request) by
closing its connection, as a browser tab or a timed-out gateway does. A server
that notices stops working for it; one that does not computes an image nobody
reads.

Scheduling fields, for servers that take them (``omni-trio serve`` does, L63):
``deadline_ms`` puts the same deadline on every request (the SLO, say: a server
that knows it can refuse or drop what it cannot finish in time), and
``priority`` with ``priority_share`` sends a ``priority`` from that share of the
clients, drawn per arrival from a stream of its own, so the arrival times and
give-ups stay those of the seed. The summary splits its figures by the priority
sent (``by_priority``).

Every request ends one way (``OUTCOMES``): ``completed`` (a 200 with its
images), ``gave_up``, ``refused`` (any other status, kept per status and error
``code``) or ``error`` (no answer: a reset connection, a timeout, a body that
is not an images answer).
``summarize`` turns the records into the figures, with no I/O: the SLO goodput
(images received within ``slo_s`` of their request, per second of the arrival
window), the throughput (every image received, per second of the window), and
the p50 and p99 latencies of the completed requests.

The module logs (``omni_trio.load``) and never prints; ``run_load_command`` writes
the table to the stream it is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

import anyio

from ._errors import CommandError, UsageError, summary
from ._types import count, fraction, header, integer, positive, span

if TYPE_CHECKING:
    import httpx

__all__ = [
    "DEFAULT_CLASS",
    "OUTCOMES",
    "PATH",
    "Arrival",
    "LoadConfig",
    "LoadResult",
    "RequestRecord",
    "add_load_arguments",
    "endpoint_url",
    "format_summary",
    "percentile",
    "poisson_schedule",
    "priority_class",
    "run_load",
    "run_load_command",
    "summarize",
]

_log = logging.getLogger("omni_trio.load")

#: The endpoint a base URL is completed with.
PATH = "/v1/images/generations"

#: How a request can end, in the order the table shows them.
OUTCOMES = ("completed", "gave_up", "refused", "error")

#: Seconds the reachability check waits for a TCP connection.
CONNECT_CHECK_S = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    """One planned request.

    Args:
        index: its rank in the schedule, from 0.
        at_s: when it is sent, in seconds after the run's start.
        give_up_s: seconds after sending at which its client gives up, or
            ``None`` for a client that waits for the answer.
        priority: the ``priority`` its body carries, or ``None`` for none.
    """

    index: int
    at_s: float
    give_up_s: float | None
    priority: int | None = None


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
    numbers.

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

    if count is not None:
        # random() is in [0, 1): every moment falls inside the window.
        moments = sorted(duration_s * rng.random() for _ in range(count))
        return tuple(arrival(index, at) for index, at in enumerate(moments))
    arrivals: list[Arrival] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= duration_s:
            return tuple(arrivals)
        arrivals.append(arrival(len(arrivals), at))


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
        ``images`` and ``good_images`` (within the SLO); ``good_requests``;
        ``goodput_per_s`` and ``throughput_per_s`` (images per second of the
        window); ``p50_latency_s`` and ``p99_latency_s`` of the completed
        requests (``None`` if none completed); ``by_priority``: per priority
        sent (``priority_class``: its number as a string, ``"default"`` for
        none), that class's ``requests``, ``completed``, images, goodput,
        throughput and latencies as above; ``duration_s`` and ``slo_s``.
    """
    counts = Counter(record.outcome for record in records)
    refused_records = [r for r in records if r.outcome == "refused"]
    refused = Counter(str(r.status) for r in refused_records)
    reasons = Counter(f"{r.status} {r.code}" if r.code else str(r.status) for r in refused_records)
    classes: dict[str, list[RequestRecord]] = {}
    for record in records:
        classes.setdefault(priority_class(record.priority), []).append(record)
    return {
        **_rates(records, duration_s=duration_s, slo_s=slo_s),
        "impatient": sum(r.give_up_s is not None for r in records),
        "counts": {outcome: counts[outcome] for outcome in OUTCOMES},
        "refused_by_status": dict(sorted(refused.items())),
        "refused_by_reason": dict(sorted(reasons.items())),
        "by_priority": {
            name: _rates(members, duration_s=duration_s, slo_s=slo_s)
            for name, members in sorted(classes.items())
        },
        "duration_s": duration_s,
        "slo_s": slo_s,
    }


def endpoint_url(url: str) -> str:
    """The images endpoint of ``url``: a base URL gets ``PATH`` appended.

    ``http://host:8000`` and ``http://host:8000/`` become
    ``http://host:8000/v1/images/generations``; a URL that already ends with it
    is kept; ``http://host/images`` (a mounted service) becomes
    ``http://host/images/v1/images/generations``.

    Raises:
        UsageError: not an ``http`` or ``https`` URL with a host.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"URL: expected http://HOST[:PORT][/PATH], e.g. http://127.0.0.1:8000, got {url!r}"
        )
    if parts.query or parts.fragment:
        raise UsageError(f"URL: give no query or fragment, got {url!r}")
    del port  # read only to check it
    base = url.rstrip("/")
    return base if base.endswith(PATH) else base + PATH


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    """One load run.

    Args:
        url: the images endpoint (see ``endpoint_url``).
        rate: mean requests per second, > 0.
        duration_s: the arrival window in seconds, > 0.
        slo_s: the latency objective in seconds, > 0.
        seed: the schedule's seed.
        give_up_fraction: the share of clients that give up, 0 to 1.
        give_up_s: the (low, high) span of a give-up moment, in seconds after
            sending; ``None`` for ``(0, 2 * slo_s)``.
        prompt: every request's prompt.
        size: ``"WxH"``, or ``None`` for the server's default.
        steps: ``num_inference_steps``, or ``None`` for the server's default.
        model: the body's ``model``, or ``None`` to leave it out.
        timeout_s: seconds a patient client waits for its answer before it
            counts an ``error``.
        headers: extra request headers (an ``Authorization``, say).
        deadline_ms: every body's ``deadline_ms``, or ``None`` to send none.
        priority: the ``priority`` a ``priority_share`` of the bodies carry
            (drawn per arrival, see ``poisson_schedule``), or ``None``: none does.
        priority_share: that share, 0 to 1.
        count: exactly this many requests in the window (see
            ``poisson_schedule``), or ``None`` for a Poisson count at ``rate``.

    Raises:
        ValueError: a value out of range; the message names it.
    """

    url: str
    rate: float
    duration_s: float
    slo_s: float
    seed: int = 0
    give_up_fraction: float = 0.3
    give_up_s: tuple[float, float] | None = None
    prompt: str = "a lighthouse at dusk"
    size: str | None = "64x64"
    steps: int | None = None
    model: str | None = None
    timeout_s: float = 300.0
    headers: tuple[tuple[str, str], ...] = field(default=())
    deadline_ms: int | None = None
    priority: int | None = None
    priority_share: float = 1.0
    count: int | None = None

    def __post_init__(self) -> None:
        for name in ("rate", "duration_s", "slo_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
        if not 0 <= self.give_up_fraction <= 1:
            raise ValueError(
                f"give_up_fraction: must be from 0 to 1, got {self.give_up_fraction!r}"
            )
        low, high = self.give_up_span
        if not (math.isfinite(high) and 0 <= low <= high):
            raise ValueError(f"give_up_s: must be 0 <= low <= high, got {(low, high)!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps!r}")
        if self.deadline_ms is not None and self.deadline_ms < 1:
            raise ValueError(f"deadline_ms: must be >= 1, got {self.deadline_ms!r}")
        if not 0 <= self.priority_share <= 1:
            raise ValueError(f"priority_share: must be from 0 to 1, got {self.priority_share!r}")
        if self.count is not None and self.count < 0:
            raise ValueError(f"count: must be >= 0, got {self.count!r}")

    @property
    def give_up_span(self) -> tuple[float, float]:
        """``give_up_s``, or its default ``(0, 2 * slo_s)``."""
        return self.give_up_s if self.give_up_s is not None else (0.0, 2 * self.slo_s)

    def schedule(self) -> tuple[Arrival, ...]:
        """This run's arrivals (``poisson_schedule``)."""
        return poisson_schedule(
            rate=self.rate,
            duration_s=self.duration_s,
            seed=self.seed,
            give_up_fraction=self.give_up_fraction,
            give_up_s=self.give_up_span,
            priority=self.priority,
            priority_share=self.priority_share,
            count=self.count,
        )

    def body(self, index: int, priority: int | None = None) -> dict[str, Any]:
        """The JSON body of request ``index`` (its seed is the index: reproducible).

        Args:
            index: the arrival's index.
            priority: its ``Arrival.priority``, sent when not ``None``.
        """
        body: dict[str, Any] = {"prompt": self.prompt, "n": 1, "seed": index}
        if self.size is not None:
            body["size"] = self.size
        if self.steps is not None:
            body["num_inference_steps"] = self.steps
        if self.model is not None:
            body["model"] = self.model
        if self.deadline_ms is not None:
            body["deadline_ms"] = self.deadline_ms
        if priority is not None:
            body["priority"] = priority
        return body

    def as_json(self) -> dict[str, Any]:
        """The configuration as JSON values (headers by name only: they may hold secrets)."""
        fields = asdict(self)
        fields["give_up_s"] = list(self.give_up_span)
        fields["headers"] = [name for name, _ in self.headers]
        return fields


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """A finished run.

    Args:
        config: what was run.
        records: one per arrival, in arrival order.
        elapsed_s: seconds from the first arrival's slot to the last answer.
    """

    config: LoadConfig
    records: tuple[RequestRecord, ...]
    elapsed_s: float

    def summary(self) -> dict[str, Any]:
        """``summarize`` of the records, over the arrival window, at the config's SLO."""
        return summarize(self.records, duration_s=self.config.duration_s, slo_s=self.config.slo_s)

    def as_json(self) -> dict[str, Any]:
        """The config, the summary, the elapsed time and every record, as JSON values."""
        return {
            "config": self.config.as_json(),
            "summary": self.summary(),
            "elapsed_s": self.elapsed_s,
            "records": [asdict(record) for record in self.records],
        }


async def _send(
    client: httpx.AsyncClient, config: LoadConfig, arrival: Arrival, started: float
) -> RequestRecord:
    """Send one request and wait for its answer, or give up; never raises an ``Exception``."""
    import httpx

    sent = anyio.current_time()

    def record(outcome: str, **extra: Any) -> RequestRecord:
        latency = anyio.current_time() - sent
        return RequestRecord(
            index=arrival.index,
            sent_s=sent - started,
            outcome=outcome,
            latency_s=latency,
            give_up_s=arrival.give_up_s,
            priority=arrival.priority,
            **extra,
        )

    give_up = math.inf if arrival.give_up_s is None else arrival.give_up_s
    response = None
    # Cancelling httpx mid-request closes its connection: the server sees the client go.
    with anyio.move_on_after(give_up):
        try:
            response = await client.post(
                config.url, json=config.body(arrival.index, arrival.priority)
            )
        except httpx.TimeoutException:
            return record("error", error=f"no answer within {config.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return record("error", error=summary(exc))
    if response is None:
        return record("gave_up")
    if response.status_code != 200:
        return record("refused", status=response.status_code, code=_error_code(response))
    try:
        data = response.json()["data"]
        images = len(data) if isinstance(data, list) else 0
    except (ValueError, KeyError, TypeError):
        images = 0
    if images == 0:
        return record("error", status=200, error="a 200 without images (not an images endpoint?)")
    return record("completed", status=200, images=images)


def _error_code(response: httpx.Response) -> str | None:
    """The ``{"error": {"code": ...}}`` of an error answer, if it has a string one."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) and code else None


def _reason(exc: OSError) -> str:
    """Why a connection failed: anyio's "All connection attempts failed" names no cause."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        cause = cause.exceptions[0]
    if isinstance(cause, OSError) and cause.errno:
        return os.strerror(cause.errno)
    return os.strerror(exc.errno) if exc.errno else str(exc)


async def check_reachable(url: str) -> None:
    """Open (and close) one TCP connection to ``url``'s host and port.

    Raises:
        CommandError: the connection fails or takes longer than ``CONNECT_CHECK_S``.

    Cancellation:
        Safe: nothing is left open.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with anyio.fail_after(CONNECT_CHECK_S):
            stream = await anyio.connect_tcp(host, port)
    except TimeoutError:
        raise CommandError(
            f"cannot reach {where}: no connection within {CONNECT_CHECK_S:g} s"
        ) from None
    except OSError as exc:
        raise CommandError(
            f"cannot reach {where}: {_reason(exc)}; is the server running?"
        ) from None
    await stream.aclose()


async def run_load(
    config: LoadConfig, *, on_record: Callable[[RequestRecord], None] | None = None
) -> LoadResult:
    """Run ``config``'s schedule against its URL; return every request's record.

    Sends each arrival at its moment (late ones at once: the loop never waits for
    an answer to send), then waits for every answer or give-up.

    Args:
        config: the run.
        on_record: called with each record as its request ends, in the caller's
            event loop.

    Returns:
        The result, its records in arrival order.

    Cancellation:
        Cancelling stops sending and closes every open connection; nothing is
        returned.
    """
    import httpx

    arrivals = config.schedule()
    records: list[RequestRecord | None] = [None] * len(arrivals)
    _log.info(
        "load: %d requests over %g s (%g/s, seed %d) to %s",
        len(arrivals),
        config.duration_s,
        config.rate,
        config.seed,
        config.url,
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s), limits=limits, headers=dict(config.headers)
    ) as client:
        started = anyio.current_time()

        async def one(arrival: Arrival) -> None:
            done = await _send(client, config, arrival, started)
            records[arrival.index] = done
            if on_record is not None:
                on_record(done)

        async with anyio.create_task_group() as tg:
            for arrival in arrivals:
                await anyio.sleep_until(started + arrival.at_s)
                tg.start_soon(one, arrival)
        elapsed = anyio.current_time() - started
    finished = tuple(record for record in records if record is not None)
    assert len(finished) == len(arrivals)
    _log.info("load: done in %.1f s: %s", elapsed, dict(Counter(r.outcome for r in finished)))
    return LoadResult(config=config, records=finished, elapsed_s=elapsed)


# -- the command ---------------------------------------------------------------------


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``load`` command's arguments to ``parser``."""
    parser.add_argument(
        "url",
        metavar="URL",
        help=f"the server, e.g. http://127.0.0.1:8000 ({PATH} is appended unless given)",
    )
    parser.add_argument(
        "--rate", type=positive, default=None, help="requests per second, mean (default 1)"
    )
    parser.add_argument(
        "--requests",
        type=count(1),
        default=None,
        metavar="N",
        help="exactly N requests over --duration, at Poisson moments (instead of --rate)",
    )
    parser.add_argument(
        "--duration", type=positive, default=30.0, metavar="S", help="seconds (default 30)"
    )
    parser.add_argument(
        "--slo-s",
        type=positive,
        default=10.0,
        metavar="S",
        help="latency objective: images within it count toward the goodput (default 10)",
    )
    parser.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    parser.add_argument(
        "--give-up-fraction",
        type=fraction,
        default=0.3,
        metavar="F",
        help="share of clients that give up, closing their connection (default 0.3)",
    )
    parser.add_argument(
        "--give-up-after",
        type=span,
        default=None,
        metavar="MAX|MIN:MAX",
        help="seconds after sending when they do, uniform in [MIN, MAX] (default 0:2xSLO)",
    )
    parser.add_argument(
        "--size", default="64x64", help="the body's size, WxH (default 64x64; 'auto': the server's)"
    )
    parser.add_argument(
        "--steps", type=count(1), default=None, help="num_inference_steps (default: the server's)"
    )
    parser.add_argument("--prompt", default="a lighthouse at dusk")
    parser.add_argument("--model", default=None, help="the body's model (default: none sent)")
    parser.add_argument(
        "--timeout",
        type=positive,
        default=300.0,
        metavar="S",
        help="seconds a patient client waits before it counts an error (default 300)",
    )
    parser.add_argument(
        "--header",
        type=header,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra request header (repeatable), e.g. 'Authorization: Bearer ...'",
    )
    parser.add_argument(
        "--deadline-ms",
        type=count(1),
        default=None,
        metavar="MS",
        help="every body's deadline_ms, e.g. the SLO (default: none sent)",
    )
    parser.add_argument(
        "--priority",
        type=integer,
        default=None,
        metavar="P",
        help="the body's priority, sent by --priority-share of the clients (default: none sent)",
    )
    parser.add_argument(
        "--priority-share",
        type=fraction,
        default=None,
        metavar="F",
        help="share of clients that send --priority, drawn per arrival (default 1: all)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="write every record and the summary"
    )


def _config(args: argparse.Namespace) -> LoadConfig:
    if args.requests is not None and args.rate is not None:
        raise UsageError("--requests: give --rate or --requests, not both")
    rate = 1.0 if args.rate is None else args.rate
    if args.requests is not None:
        rate = args.requests / args.duration
    if args.priority_share is not None and args.priority is None:
        raise UsageError("--priority-share: give --priority too (the priority that share sends)")
    try:
        return LoadConfig(
            url=endpoint_url(args.url),
            rate=rate,
            duration_s=args.duration,
            slo_s=args.slo_s,
            seed=args.seed,
            give_up_fraction=args.give_up_fraction,
            give_up_s=args.give_up_after,
            prompt=args.prompt,
            size=None if args.size == "auto" else args.size,
            steps=args.steps,
            model=args.model,
            timeout_s=args.timeout,
            headers=tuple(args.header),
            deadline_ms=args.deadline_ms,
            priority=args.priority,
            priority_share=1.0 if args.priority_share is None else args.priority_share,
            count=args.requests,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The short table ``omni-trio load`` prints: outcomes, then the figures.

    With more than one priority class (or any priority sent), a line per class
    follows: its goodput and p99 latency.
    """
    counts = summary["counts"]
    lines = ["outcome          requests"]
    for outcome in OUTCOMES:
        if outcome == "refused" and summary["refused_by_reason"]:
            for reason, count in summary["refused_by_reason"].items():
                lines.append(f"  {f'refused ({reason})':<16}{count:>7}")
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
    return "\n".join(lines) + "\n"


def _open_json(path: Path) -> TextIO:
    """``path`` opened for writing now, so that a bad one fails before the run, not after.

    Not truncated: a run that fails leaves an earlier file as it was. Truncate it
    before writing.

    Raises:
        UsageError: it cannot be opened.
    """
    try:
        return open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o666), "w")
    except OSError as exc:
        raise UsageError(f"--json: cannot write {str(path)!r}: {exc.strerror}") from None


def _scheduling(config: LoadConfig, summary: Mapping[str, Any]) -> str:
    """The header line's words on ``deadline_ms`` and ``priority``, if any was sent."""
    words = ""
    if config.deadline_ms is not None:
        words += f"; deadline_ms {config.deadline_ms}"
    if config.priority is not None:
        sent = summary["by_priority"].get(priority_class(config.priority), {}).get("requests", 0)
        words += f"; {sent} send priority {config.priority}"
    return words


def run_load_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``omni-trio load``: check the server answers, run the load, print and save the result.

    Returns:
        0 once the run is done (whatever its outcomes).

    Raises:
        UsageError: a bad URL or option, a ``--json`` path that cannot be written.
        CommandError: the server cannot be reached, or every request was answered
            404 or 405 (the URL is not an images endpoint).
    """
    out = sys.stdout if out is None else out
    config = _config(args)
    with contextlib.ExitStack() as stack:
        saved = None if args.json is None else stack.enter_context(_open_json(args.json))

        async def main() -> LoadResult:
            await check_reachable(config.url)
            return await run_load(config)

        result = anyio.run(main, backend="trio")
        if saved is not None:
            saved.truncate(0)
            saved.write(json.dumps(result.as_json(), indent=2) + "\n")
    summary_ = result.summary()
    low, high = config.give_up_span
    out.write(
        f"{summary_['requests']} requests at {config.rate:g}/s for {config.duration_s:g} s"
        f" (seed {config.seed}) to {config.url}; {summary_['impatient']} mean to give up"
        f" {low:g} to {high:g} s after sending" + _scheduling(config, summary_) + "\n"
    )
    out.write(format_summary(summary_))
    statuses = set(summary_["refused_by_status"])
    if summary_["counts"]["refused"] == summary_["requests"] > 0 and statuses <= {"404", "405"}:
        raise CommandError(
            f"URL: every request was answered {'/'.join(sorted(statuses))}: is {config.url}"
            " an images endpoint?"
        )
    return 0
