"""``omni-trio load URL``'s client: an open-loop load test of an OpenAI-style images endpoint.

The arrivals are ``poisson_schedule``'s (``_loadtest_math``). Each arrival is a
client of its own: it opens a connection (no keep-alive, so no client waits for
another's connection), POSTs a small generation body and waits for the answer. A
``give_up_fraction`` of them are impatient: each gives up at a moment drawn
uniformly from ``give_up_s`` (seconds after it sent its request) by closing its
connection, as a browser tab or a timed-out gateway does. A server that notices
stops working for it; one that does not computes an image nobody reads.

Scheduling fields, for servers that take them (``omni-trio serve`` does, L63):
``deadline_ms`` puts the same deadline on every request (the SLO, say: a server
that knows it can refuse or drop what it cannot finish in time), and
``priority`` with ``priority_share`` sends a ``priority`` from that share of the
clients, drawn per arrival from a stream of its own, so the arrival times and
give-ups stay those of the seed.

Tenants (``LoadConfig.tenants``): several clients in one run, each a ``Tenant``
with a relative rate and, for a server with API keys (L55), a key it sends as
``Authorization: Bearer KEY``. They split the same arrivals by rate
(``poisson_schedule``); a key is never logged, and ``as_json`` says only whether a
tenant had one.

The module logs (``omni_trio.load``) and never prints.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import anyio

from ._errors import CommandError, UsageError, summary
from ._loadtest_math import Arrival, RequestRecord, poisson_schedule, summarize

if TYPE_CHECKING:
    import httpx

__all__ = [
    "CONNECT_CHECK_S",
    "MAX_MESSAGE_CHARS",
    "PATH",
    "LoadConfig",
    "LoadResult",
    "Tenant",
    "check_reachable",
    "endpoint_url",
    "run_load",
]

_log = logging.getLogger("omni_trio.load")

#: The endpoint a base URL is completed with.
PATH = "/v1/images/generations"

#: Seconds the reachability check waits for a TCP connection.
CONNECT_CHECK_S = 5.0


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
class Tenant:
    """One client of a run with tenants.

    Args:
        name: its name in the summary (the server knows it by its key, not this).
        rate: its rate relative to the other tenants' (the run's ``rate`` is the
            total), > 0.
        key: the API key it sends as ``Authorization: Bearer KEY``, or ``None``
            to send none (an open server). Never shown: ``repr`` leaves it out.

    Raises:
        ValueError: an empty name, a rate that is not a finite number > 0, or a
            key that cannot be a header value (the message never holds the key).
    """

    name: str
    rate: float = 1.0
    key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenant: a name must not be empty")
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(
                f"tenant {self.name!r}: rate must be a finite number > 0, got {self.rate!r}"
            )
        key = self.key
        if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
            raise ValueError(f"tenant {self.name!r}: a key must be printable ASCII without spaces")

    @property
    def headers(self) -> dict[str, str]:
        """The headers its requests carry: its ``Authorization``, if it has a key."""
        return {} if self.key is None else {"Authorization": f"Bearer {self.key}"}


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
        tenants: the tenants that share the arrivals by rate, each with its
            key (distinct names), or none: one client, as before.

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
    tenants: tuple[Tenant, ...] = ()

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
        names = [tenant.name for tenant in self.tenants]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"tenants: {name!r} is given twice")

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
            tenants=[(tenant.name, tenant.rate) for tenant in self.tenants],
        )

    def headers_of(self, tenant: str | None) -> dict[str, str]:
        """The headers of a request that ``tenant`` sends (``Tenant.headers``)."""
        for candidate in self.tenants:
            if candidate.name == tenant:
                return candidate.headers
        return {}

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
        """The configuration as JSON values (headers by name only, tenants with no key:
        they may hold secrets; ``keyed``: whether a tenant sends one)."""
        fields = asdict(self)
        fields["give_up_s"] = list(self.give_up_span)
        fields["headers"] = [name for name, _ in self.headers]
        fields["tenants"] = [
            {"name": t.name, "rate": t.rate, "keyed": t.key is not None} for t in self.tenants
        ]
        return fields


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """A finished run.

    A run stopped early (``run_load``'s ``stop``) holds the requests that ended
    before the stop; its figures are over the part of the window it ran.

    Args:
        config: what was run.
        records: one per request that ended (every arrival, unless stopped), in
            arrival order.
        elapsed_s: seconds from the first arrival's slot to the last answer (or
            to the stop).
        stopped_s: ``None`` for a run that went to its end; else when it was
            stopped, in seconds after its start.
        unanswered: requests sent but still unanswered at the stop: cut, and not
            in ``records``.
    """

    config: LoadConfig
    records: tuple[RequestRecord, ...]
    elapsed_s: float
    stopped_s: float | None = None
    unanswered: int = 0

    @property
    def window_s(self) -> float:
        """The seconds of the arrival window the run covered: all of it, unless stopped."""
        duration = self.config.duration_s
        return duration if self.stopped_s is None else min(self.stopped_s, duration) or duration

    def summary(self) -> dict[str, Any]:
        """``summarize`` of the records, over the window covered, at the config's SLO."""
        return summarize(self.records, duration_s=self.window_s, slo_s=self.config.slo_s)

    def as_json(self) -> dict[str, Any]:
        """The config, the summary, the elapsed time, the stop and every record, as JSON values."""
        return {
            "config": self.config.as_json(),
            "summary": self.summary(),
            "elapsed_s": self.elapsed_s,
            "stopped_s": self.stopped_s,
            "unanswered": self.unanswered,
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
            tenant=arrival.tenant,
            **extra,
        )

    give_up = math.inf if arrival.give_up_s is None else arrival.give_up_s
    response = None
    # Cancelling httpx mid-request closes its connection: the server sees the client go.
    with anyio.move_on_after(give_up):
        try:
            response = await client.post(
                config.url,
                json=config.body(arrival.index, arrival.priority),
                headers=config.headers_of(arrival.tenant),
            )
        except httpx.TimeoutException:
            return record("error", error=f"no answer within {config.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return record("error", error=summary(exc))
    if response is None:
        return record("gave_up")
    if response.status_code != 200:
        code, message = _error(response)
        return record("refused", status=response.status_code, code=code, message=message)
    try:
        data = response.json()["data"]
        images = len(data) if isinstance(data, list) else 0
    except (ValueError, KeyError, TypeError):
        images = 0
    if images == 0:
        return record("error", status=200, error="a 200 without images (not an images endpoint?)")
    return record("completed", status=200, images=images)


#: The most characters of a refusal's message a record keeps.
MAX_MESSAGE_CHARS = 200


def _error(response: httpx.Response) -> tuple[str | None, str | None]:
    """The ``{"error": {"code": ..., "message": ...}}`` of an error answer, each if a string.

    The message is kept to its first line and ``MAX_MESSAGE_CHARS``.
    """
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    code, message = error.get("code"), error.get("message")
    if isinstance(message, str) and message.strip():
        message = message.strip().splitlines()[0][:MAX_MESSAGE_CHARS]
    else:
        message = None
    return (code if isinstance(code, str) and code else None), message


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
    config: LoadConfig,
    *,
    on_record: Callable[[RequestRecord], None] | None = None,
    stop: anyio.Event | None = None,
) -> LoadResult:
    """Run ``config``'s schedule against its URL; return every request's record.

    Sends each arrival at its moment (late ones at once: the loop never waits for
    an answer to send), then waits for every answer or give-up.

    Args:
        config: the run.
        on_record: called with each record as its request ends, in the caller's
            event loop.
        stop: when set, the run stops: nothing more is sent, the requests still
            unanswered are cut (their connections closed), and the result holds
            the records so far (``LoadResult.stopped_s``).

    Returns:
        The result, its records in arrival order.

    Cancellation:
        Cancelling stops sending and closes every open connection; nothing is
        returned (``stop`` is the way to keep the records so far).
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
    if config.tenants:
        sends = Counter(a.tenant for a in arrivals)
        _log.info(
            "load: tenants %s",
            ", ".join(
                f"{t.name} {sends[t.name]}{' (key)' if t.key else ''}" for t in config.tenants
            ),
        )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    sent = 0
    stopped: float | None = None
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(config.timeout_s), limits=limits, headers=dict(config.headers)
    ) as client:
        started = anyio.current_time()

        async def one(arrival: Arrival) -> None:
            done = await _send(client, config, arrival, started)
            records[arrival.index] = done
            if on_record is not None:
                on_record(done)

        with anyio.CancelScope() as running:
            async with anyio.create_task_group() as tg:
                if stop is not None:

                    async def watch(stop: anyio.Event) -> None:
                        nonlocal stopped
                        await stop.wait()
                        stopped = anyio.current_time() - started
                        running.cancel()  # the requests in flight too: their connections close

                    tg.start_soon(watch, stop)
                async with anyio.create_task_group() as requests:
                    for arrival in arrivals:
                        await anyio.sleep_until(started + arrival.at_s)
                        requests.start_soon(one, arrival)
                        sent += 1
                tg.cancel_scope.cancel()  # every request ended: the watcher has nothing to stop
        elapsed = anyio.current_time() - started
    finished = tuple(record for record in records if record is not None)
    assert stopped is not None or len(finished) == len(arrivals)
    outcomes = dict(Counter(r.outcome for r in finished))
    if stopped is None:
        _log.info("load: done in %.1f s: %s", elapsed, outcomes)
    else:
        _log.info("load: stopped after %.1f s: %s, %d cut", stopped, outcomes, sent - len(finished))
    return LoadResult(
        config=config,
        records=finished,
        elapsed_s=elapsed,
        stopped_s=stopped,
        unanswered=sent - len(finished),
    )
