"""API keys and tenants (L55, L56): who may call the server, as whom, and how much.

- ``ApiKey``: one accepted key, kept as its SHA-256 digest only, with its tenant,
  the tenant's weight and limits (``TenantLimits``) and whether it is an admin key;
- ``ApiKeys``: every accepted key, and whether ``/metrics`` needs one; built from
  plain keys (``from_keys``: ``serve --api-key``, ``OMNI_TRIO_API_KEYS``) and a
  keys file (``load_keys_file``: TOML or JSON), merged with ``merged``;
- ``KeyGate``: the ASGI middleware that checks ``Authorization: Bearer <key>`` on
  every route but ``/health`` (and ``/metrics`` unless ``metrics_auth``), answers
  401 otherwise, and puts the caller (its ``ApiKey``) in the scope
  (``caller``, ``tenant_request``); a route that changes the server calls
  ``require_admin``;
- ``RateLimiter``: requests per minute per tenant, GCRA (a token bucket kept as
  one time per tenant), answering 429 with ``Retry-After`` at once.

Comparison is in constant time: the presented key's digest is compared with
``hmac.compare_digest`` against every accepted digest, all of them, whatever
matches. A key is never logged, echoed or kept: only digests are stored, and
``repr`` shows none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import string
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._request import GenerationRequest
from .._validate import check_tenant, check_tenant_weight, fail_config
from ._asgi import Receive, Scope, Send, send_error
from ._errors import ApiError

__all__ = [
    "CALLER",
    "ApiKey",
    "ApiKeys",
    "KeyGate",
    "RateLimiter",
    "TenantLimits",
    "caller",
    "caller_tenant",
    "check_key",
    "check_running_jobs",
    "load_keys_file",
    "require_admin",
    "tenant_request",
    "viewer",
]

_log = logging.getLogger("omni_trio.serve")

#: The scope key under which ``KeyGate`` puts the caller's ``ApiKey``.
CALLER = "omni_trio.caller"

#: The routes that are open whatever the keys: a load balancer's probe.
OPEN_PATHS = frozenset({"/health"})

#: The routes whose ``POST`` makes work: what requests per minute count.
WORK_PATHS = frozenset({"/v1/images/generations", "/v1/images/edits", "/v1/videos"})

_SHA256 = "sha256:"

App = Callable[[Scope, Receive, Send], Awaitable[None]]


#: What a key is made of: printable ASCII but the space. A header is bytes, and
#: clients send other characters in encodings that differ (UTF-8, Latin-1, or not at
#: all): such a key could never be matched alike, so none is accepted.
_KEY_CHARS = frozenset(string.printable) - frozenset(string.whitespace)


def digest(key: str) -> bytes:
    """The SHA-256 digest of ``key`` (its UTF-8 bytes): what is stored and compared.

    An accepted key is ASCII (``check_key``), whose UTF-8 bytes are its Latin-1
    bytes: the ones ``presented_key`` reads from a header.
    """
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantLimits:
    """A tenant's limits (L56); ``None``: none beyond the server's own.

    Args:
        max_waiting: the most of its requests waiting in the engine at once
            (``EngineConfig.tenant_max_waiting``): over it, 429 ``queue_full``.
        max_running_jobs: the most of its video jobs not finished at once: over
            it, 429 ``tenant_jobs_full``.
        requests_per_minute: its sustained rate of generation requests (``POST``
            of images, edits and videos): over it, 429 ``rate_limited``.
        burst: how many of those may come at once (the bucket's size); default
            a tenth of a minute's worth, at least 1.
    """

    max_waiting: int | None = None
    max_running_jobs: int | None = None
    requests_per_minute: float | None = None
    burst: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_waiting", "max_running_jobs", "burst"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        rate = self.requests_per_minute
        if rate is not None:
            if not isinstance(rate, int | float) or isinstance(rate, bool):
                raise ValueError(f"requests_per_minute: must be a number, got {rate!r}")
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"requests_per_minute: must be finite and > 0, got {rate!r}")
            object.__setattr__(self, "requests_per_minute", float(rate))

    @property
    def bucket(self) -> int:
        """The burst the rate allows (see ``burst``)."""
        if self.burst is not None:
            return self.burst
        return max(1, int((self.requests_per_minute or 0.0) / 10))


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiKey:
    """One accepted key: its SHA-256 digest, its tenant, weight, limits and admin flag.

    Build one from the key itself with ``ApiKey.of(key, ...)``, or from a digest
    (a keys file's ``sha256:<hex>``). ``repr`` shows the tenant, never the digest.
    The tenant is a name as ``GenerationRequest.tenant``'s, the weight as
    ``EngineConfig.tenant_weights``' (0.001 to 1000).
    """

    digest: bytes = field(repr=False)
    tenant: str
    weight: float = 1.0
    limits: TenantLimits = field(default_factory=TenantLimits)
    admin: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != 32:
            raise ValueError("digest: must be the 32 bytes of a SHA-256 digest")
        object.__setattr__(self, "tenant", check_tenant(fail_config, "tenant", self.tenant))
        object.__setattr__(self, "weight", check_tenant_weight(fail_config, "weight", self.weight))
        if not isinstance(self.admin, bool):
            raise ValueError(f"admin: must be a bool, got {self.admin!r}")

    @classmethod
    def of(cls, key: str, **fields: Any) -> ApiKey:
        """The entry of the plain ``key`` (its digest is kept, the key is not)."""
        check_key(key)
        return cls(digest=digest(key), **fields)


def check_key(key: object) -> None:
    """Refuse what cannot be a key: one line that never shows the key.

    Raises:
        ValueError: not a string, empty, or with a character that is not printable
            ASCII, or a space (see ``_KEY_CHARS``).
    """
    if not isinstance(key, str) or not key:
        raise ValueError("an API key must be a non-empty string")
    if not _KEY_CHARS.issuperset(key):
        raise ValueError(
            "an API key must be printable ASCII without spaces: clients send other"
            " characters in encodings that differ, so it would never match"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiKeys:
    """Every key the server accepts (L55), and whether ``/metrics`` needs one.

    Tenants that several keys share must agree on their weight and limits.
    """

    keys: tuple[ApiKey, ...] = ()
    #: Whether ``/metrics`` needs a key too (it is open by default: a scraper's).
    metrics_auth: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        seen: dict[str, ApiKey] = {}
        digests: set[bytes] = set()
        for key in self.keys:
            if not isinstance(key, ApiKey):
                raise ValueError(f"keys: must be ApiKey entries, got {type(key).__name__}")
            if key.digest in digests:
                raise ValueError(f"keys: a key is given twice (tenant {key.tenant!r})")
            digests.add(key.digest)
            first = seen.setdefault(key.tenant, key)
            if (first.weight, first.limits) != (key.weight, key.limits):
                raise ValueError(
                    f"keys: the keys of tenant {key.tenant!r} disagree on its weight or limits"
                )

    @classmethod
    def from_keys(cls, keys: Iterable[str], *, metrics_auth: bool = False) -> ApiKeys:
        """Plain keys (``--api-key``, ``OMNI_TRIO_API_KEYS``): tenants ``key1``, ``key2``, ...

        Each is an admin key: whoever holds the server's own keys runs it; a keys
        file gives keys that are not.
        """
        entries = tuple(
            ApiKey.of(key, tenant=f"key{index}", admin=True)
            for index, key in enumerate(dict.fromkeys(keys), start=1)
        )
        return cls(keys=entries, metrics_auth=metrics_auth)

    def merged(self, other: ApiKeys) -> ApiKeys:
        """These keys and ``other``'s; ``/metrics`` keyed if either says so."""
        return ApiKeys(
            keys=(*self.keys, *other.keys), metrics_auth=self.metrics_auth or other.metrics_auth
        )

    def __bool__(self) -> bool:
        return bool(self.keys)

    def find(self, presented: str) -> ApiKey | None:
        """The entry of ``presented``, if it is a key; in constant time over the keys.

        Every accepted digest is compared (``hmac.compare_digest``), whatever
        matched before, so the time says nothing about which key, or how much of
        one, matched.
        """
        wanted = digest(presented)
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(wanted, key.digest):
                found = key
        return found

    @property
    def tenants(self) -> tuple[str, ...]:
        """The tenants, in the order their first key was given."""
        return tuple(dict.fromkeys(key.tenant for key in self.keys))

    def tenant_limits(self) -> dict[str, TenantLimits]:
        """Each tenant's limits."""
        return {key.tenant: key.limits for key in self.keys}

    def weights(self) -> dict[str, float]:
        """Each tenant's weight, for ``EngineConfig.tenant_weights`` (L57)."""
        return {key.tenant: key.weight for key in self.keys}

    def max_waiting(self) -> dict[str, int]:
        """Each tenant's waiting bound, for ``EngineConfig.tenant_max_waiting`` (L56)."""
        return {
            key.tenant: key.limits.max_waiting
            for key in self.keys
            if key.limits.max_waiting is not None
        }


_ENTRY_FIELDS = frozenset(
    {"key", "tenant", "weight", "admin", *(f.name for f in dataclasses.fields(TenantLimits))}
)


def load_keys_file(path: str | Path) -> ApiKeys:
    """Read a keys file: TOML (``.toml``) or JSON (anything else), a list of entries.

    TOML: ``[[keys]]`` tables; JSON: ``{"keys": [...]}``. Each entry has ``key``
    (the key itself, or ``"sha256:<hex>"``, its digest, so the file need not hold
    the secret), ``tenant``, and optionally ``weight`` (1), ``admin`` (false),
    ``max_waiting``, ``max_running_jobs``, ``requests_per_minute`` and ``burst``.
    An optional top-level ``metrics_auth`` (false) keys ``/metrics``.

    Raises:
        ValueError: the file cannot be read or parsed, or an entry is wrong; the
            message names the entry by its position, never its key.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"the keys file {path} cannot be read: {exc.strerror}") from None
    try:
        if path.suffix.lower() == ".toml":
            document: object = tomllib.loads(raw.decode("utf-8"))
        else:
            document = json.loads(raw)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        # The parser's message may quote the line: never a key in an error.
        raise ValueError(
            f"the keys file {path} is not valid {type(exc).__name__.split('Decode')[0]}"
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError(f"the keys file {path} needs a list of entries under 'keys'")
    unknown = set(document) - {"keys", "metrics_auth"}
    if unknown:
        raise ValueError(f"the keys file {path}: unknown settings {sorted(unknown)}")
    metrics_auth = document.get("metrics_auth", False)
    if not isinstance(metrics_auth, bool):
        raise ValueError(f"the keys file {path}: metrics_auth must be true or false")
    entries = []
    for index, entry in enumerate(document["keys"], start=1):
        try:
            entries.append(_entry(entry))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"the keys file {path}, entry {index}: {exc}") from None
    try:
        return ApiKeys(keys=tuple(entries), metrics_auth=metrics_auth)
    except ValueError as exc:
        raise ValueError(f"the keys file {path}: {exc}") from None


def _entry(entry: object) -> ApiKey:
    if not isinstance(entry, dict):
        raise ValueError("must be a table of key, tenant, ...")
    unknown = set(entry) - _ENTRY_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    if "key" not in entry or "tenant" not in entry:
        raise ValueError("needs a key and a tenant")
    key = entry["key"]
    if not isinstance(key, str):
        raise ValueError("key: must be a string")
    limits = TenantLimits(
        **{
            name: entry[name]
            for name in _ENTRY_FIELDS - {"key", "tenant", "weight", "admin"}
            if name in entry
        }
    )
    fields: dict[str, Any] = {
        "tenant": entry["tenant"],
        "weight": entry.get("weight", 1.0),
        "admin": entry.get("admin", False),
        "limits": limits,
    }
    if key.startswith(_SHA256):
        hexdigest = key.removeprefix(_SHA256)
        try:
            raw = bytes.fromhex(hexdigest)
        except ValueError:
            raise ValueError("key: sha256: needs 64 hex digits") from None
        if len(raw) != 32:
            raise ValueError("key: sha256: needs 64 hex digits")
        return ApiKey(digest=raw, **fields)
    return ApiKey.of(key, **fields)


# -- the gate ------------------------------------------------------------------


def caller(scope: Mapping[str, Any]) -> ApiKey | None:
    """The key the request came with (``KeyGate`` checked it); ``None`` on an open server."""
    found = scope.get(CALLER)
    return found if isinstance(found, ApiKey) else None


def caller_tenant(scope: Mapping[str, Any]) -> str | None:
    """The caller's tenant, for metrics; ``None`` on an open server."""
    key = caller(scope)
    return None if key is None else key.tenant


def viewer(scope: Mapping[str, Any]) -> str | None:
    """The tenant whose video jobs alone the caller sees (L55): a key's that is not an
    admin key; ``None`` (every job) for an admin key and on an open server."""
    key = caller(scope)
    return None if key is None or key.admin else key.tenant


def check_running_jobs(key: ApiKey, running: int, retry_after_s: int) -> None:
    """Refuse a new video job of ``key``'s tenant, which has ``running`` unfinished (L56).

    Raises:
        ApiError: 429 ``tenant_jobs_full`` at its ``max_running_jobs``.
    """
    limit = key.limits.max_running_jobs
    if limit is not None and running >= limit:
        raise ApiError(
            429,
            f"tenant {key.tenant!r} has {running} video jobs running, its most:"
            " retry once one has finished",
            type="rate_limit_error",
            code="tenant_jobs_full",
            headers={"Retry-After": str(retry_after_s)},
        )


def tenant_request(request: GenerationRequest, scope: Mapping[str, Any]) -> GenerationRequest:
    """``request`` as its caller's tenant's (L57): unchanged on an open server."""
    key = caller(scope)
    if key is None or request.tenant == key.tenant:
        return request
    return dataclasses.replace(request, tenant=key.tenant)


def require_admin(scope: Mapping[str, Any], action: str = "this route") -> None:
    """Refuse ``action`` (what the route does, for the message) unless an admin key sent it.

    The one check every admin route makes (loading and unloading adapters).
    On an open server (no keys) every caller may: it is open by its operator's
    choice, and says so in its log at start.

    Raises:
        ApiError: 403 ``admin_required``.
    """
    key = caller(scope)
    if key is None or key.admin:
        return
    raise ApiError(
        403,
        f"{action} needs an admin key",
        type="permission_error",
        code="admin_required",
    )


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        headers={"WWW-Authenticate": 'Bearer realm="omni_trio"'},
    )


def presented_key(scope: Mapping[str, Any]) -> str:
    """The key of the request's ``Authorization: Bearer <key>`` header.

    Raises:
        ApiError: 401 ``invalid_api_key``: no header, another scheme, no key, or
            more than one header.
    """
    values = [
        bytes(value) for name, value in scope.get("headers", ()) if bytes(name) == b"authorization"
    ]
    if not values:
        raise _unauthorized("no API key: send it in an Authorization header, as 'Bearer <key>'")
    if len(values) > 1:
        raise _unauthorized("more than one Authorization header")
    scheme, _, key = values[0].decode("latin-1").strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key or " " in key:
        raise _unauthorized("the Authorization header must be 'Bearer <key>'")
    return key


class RateLimiter:
    """Requests per minute per tenant (L56): GCRA, one theoretical arrival time each.

    A tenant at ``r`` requests per minute with a bucket of ``b`` may send ``b`` at
    once, then one every ``60 / r`` seconds; a request beyond that is refused with
    the seconds until one fits. O(1) per request; memory: one float per tenant
    that sent a request (tenants are the keys file's, a bounded set).

    Args:
        clock: seconds, monotonic (``time.monotonic``; tests pass a virtual one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._arrival: dict[str, float] = {}

    def admit(self, tenant: str, limits: TenantLimits) -> float | None:
        """Count one request of ``tenant``; ``None`` if it fits, else the seconds to wait."""
        rate = limits.requests_per_minute
        if rate is None:
            return None
        interval = 60.0 / rate
        tolerance = (limits.bucket - 1) * interval
        now = self._clock()
        arrival = max(self._arrival.get(tenant, now), now)
        wait = arrival - now - tolerance
        if wait > 0:
            return wait
        self._arrival[tenant] = arrival + interval
        return None


class KeyGate:
    """Check every request's key before the app sees it (L55); count its rate (L56).

    With no keys it passes everything through. With keys: ``/health`` is open, and
    ``/metrics`` unless ``keys.metrics_auth``; everything else, any method, any
    path (a 404 too), needs a key: without a valid one, 401 with OpenAI's error
    body. A ``POST`` that makes work counts against its tenant's requests per
    minute (429 ``rate_limited`` with ``Retry-After`` over it). The app then sees
    the caller's ``ApiKey`` in the scope (``caller``).

    Args:
        app: the app behind the gate.
        keys: the accepted keys; ``None`` or empty: an open server.
        limiter: the tenants' rates.
        refused: called with each refusal of a generation request (its
            ``ApiError``) and the tenant, if known, for the metrics.
        open_prefixes: paths whose ``GET`` and ``HEAD`` need no key: the signed
            URLs of the outputs (``/v1/files/``, L97), which are their own credential.
    """

    def __init__(
        self,
        app: App,
        *,
        keys: ApiKeys | None,
        limiter: RateLimiter | None = None,
        refused: Callable[[ApiError, str | None], None] | None = None,
        open_prefixes: tuple[str, ...] = (),
    ) -> None:
        self._app = app
        self._open_prefixes = open_prefixes
        self._keys = keys if keys else None
        self._limiter = limiter if limiter is not None else RateLimiter()
        self._refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self._keys
        if keys is None or scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = scope.get("path", "")
        if (
            path in OPEN_PATHS
            or (path == "/metrics" and not keys.metrics_auth)
            or (path.startswith(self._open_prefixes) and scope.get("method") in ("GET", "HEAD"))
        ):
            await self._app(scope, receive, send)
            return
        key: ApiKey | None = None
        work = scope.get("method") == "POST" and path in WORK_PATHS
        try:
            key = keys.find(presented_key(scope))
            if key is None:
                raise _unauthorized("the API key is not valid")
            if work:
                wait = self._limiter.admit(key.tenant, key.limits)
                if wait is not None:
                    raise ApiError(
                        429,
                        f"tenant {key.tenant!r} sent more than its"
                        f" {key.limits.requests_per_minute:g} requests per minute",
                        type="rate_limit_error",
                        code="rate_limited",
                        headers={"Retry-After": str(max(1, math.ceil(wait)))},
                    )
        except ApiError as error:
            await self._refuse(send, error, key, counted=work)
            return
        await self._app({**scope, CALLER: key}, receive, send)

    async def _refuse(
        self, send: Send, error: ApiError, key: ApiKey | None, *, counted: bool
    ) -> None:
        tenant = None if key is None else key.tenant
        # Never the key: the status and the code, and the tenant once it is known.
        _log.info("refused %s %s", error.status, error.code, extra={"tenant": tenant})
        if counted and self._refused is not None:
            self._refused(error, tenant)
        await send_error(send, error)
