"""Step caching, as data: a request's policy (``StepCache``) and what it did (``CacheMetrics``).

A policy rides on the request (``GenerationRequest.cache``, or the engine's
``EngineConfig.default_cache``); a runner that declares the kind in
``RunnerCapabilities.step_cache`` applies it, keeping the cache state with the
request's own state (L80-L82). Two kinds skip work inside a model call, row by row:

- ``"first-block"``: the first transformer block runs for every row; a row whose
  first-block residual changed by less than ``threshold`` (relative L1, against the
  last call it computed) takes its cached residual of the other blocks instead of
  running them;
- ``"taylorseer"``: a row computes every ``interval``-th model call and forecasts the
  other blocks' residual in between from a Taylor expansion (finite differences of
  the calls it computed, up to ``order``).

``"none"`` opts a request out of an engine-wide default. Torch-free.

Beside them, ``PromptCacheMetrics``: what a runner's prompt-embedding cache (L94) did
for one request's texts. ``CacheMetrics`` and it are what a runner reports of a
request's state and the engine reads just before its discard, into ``RequestMetrics``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, NoReturn, TypeAlias

from ._validate import check_float, check_int, fail_request

__all__ = [
    "CACHE_KINDS",
    "MAX_CACHE_CALLS",
    "MAX_CACHE_THRESHOLD",
    "CacheKind",
    "CacheMetrics",
    "PromptCacheMetrics",
    "StepCache",
    "parse_step_cache",
]

#: What a policy does: skip by the first block's change, forecast, or nothing.
CacheKind: TypeAlias = Literal["first-block", "taylorseer", "none"]

#: The kinds, in the order the docs list them.
CACHE_KINDS: tuple[CacheKind, ...] = ("first-block", "taylorseer", "none")

#: The largest ``threshold`` (and ``max_threshold``) accepted. The change ratio is a
#: relative L1 distance: about 2 when a residual flips sign, so a threshold past a few
#: already skips every call after the warm-up; this bound only keeps numbers sane.
MAX_CACHE_THRESHOLD = 100.0

#: The largest ``warmup``, ``interval`` and ``max_consecutive``: beyond any step count
#: an engine takes (``EngineConfig.max_steps`` is 1000 by default).
MAX_CACHE_CALLS = 100_000

#: Each kind's defaults for the fields left ``None``: diffusers' own for its hooks
#: (``FirstBlockCacheConfig``'s threshold 0.05; ``TaylorSeerCacheConfig``'s interval 5,
#: three calls computed first, first order).
_DEFAULTS: Mapping[str, Mapping[str, object]] = {
    "first-block": {"threshold": 0.05, "warmup": 1},
    "taylorseer": {"interval": 5, "order": 1, "warmup": 3},
    "none": {},
}

#: The fields each kind takes (``warmup`` both; the rest one kind each).
_FIELDS_OF: Mapping[str, frozenset[str]] = {
    "first-block": frozenset({"threshold", "warmup", "max_consecutive", "max_threshold"}),
    "taylorseer": frozenset({"interval", "order", "warmup"}),
    "none": frozenset(),
}


def _fail(name: str, message: str) -> NoReturn:
    """Refuse the policy: the request's field is ``cache``, the message names the policy's."""
    fail_request("cache", f"{name}: {message}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCache:
    """A request's step-cache policy (L80), checked when it is built.

    Args:
        kind: ``"first-block"``, ``"taylorseer"`` or ``"none"`` (no caching: opts a
            request out of ``EngineConfig.default_cache``).
        threshold: first-block: a row skips a model call's other blocks when the
            relative L1 change of its first block's residual (``mean|r - r'| /
            mean|r'|``, ``r'`` that of the last call the row computed, as
            diffusers' ``FirstBlockCacheConfig`` measures it) is below this; 0 never
            skips. Finite, in [0, ``MAX_CACHE_THRESHOLD``]; ``None``: 0.05.
        warmup: model calls a row always computes first, >= 1; ``None``: 1 for
            first-block, 3 for taylorseer.
        max_consecutive: first-block: the most model calls in a row one row may
            skip before it computes again; ``None``: no bound.
        max_threshold: first-block: how far the engine may raise ``threshold`` when
            the request's deadline is at risk (L84); ``None`` (the default): never.
            At least ``threshold``.
        interval: taylorseer: after the warm-up, a row computes one model call in
            this many and forecasts the others; 1 never skips. ``None``: 5.
        order: taylorseer: the Taylor expansion's order, 1 or 2; ``None``: 1.

    A field of the other kind is refused; the ``None``\\s of this kind are stored as
    their defaults, so equal policies compare equal however they were written.

    Raises:
        InvalidRequestError: a field has a wrong type or value (``field`` is
            ``"cache"``, the message names the policy's field).
    """

    kind: CacheKind
    threshold: float | None = None
    warmup: int | None = None
    max_consecutive: int | None = None
    max_threshold: float | None = None
    interval: int | None = None
    order: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if not isinstance(kind, str):
            _fail("kind", f"must be a str, got {type(kind).__name__}")
        if kind not in CACHE_KINDS:
            _fail("kind", f"must be one of {list(CACHE_KINDS)}, got {kind[:40]!r}")
        store = object.__setattr__
        store(self, "kind", str(kind))  # the exact built-in
        allowed = _FIELDS_OF[kind]
        for name in _POLICY_FIELDS:
            if name not in allowed and getattr(self, name) is not None:
                _fail(name, f"does not apply to kind {kind!r}")
        for name, default in _DEFAULTS[kind].items():
            if getattr(self, name) is None:
                store(self, name, default)
        self._check_numbers()

    def _check_numbers(self) -> None:
        store = object.__setattr__
        for name in ("threshold", "max_threshold"):
            value = getattr(self, name)
            if value is not None:
                number = check_float(_fail, name, value, minimum=0.0, maximum=MAX_CACHE_THRESHOLD)
                store(self, name, number)
        for name in ("warmup", "max_consecutive", "interval"):
            value = getattr(self, name)
            if value is not None:
                store(
                    self,
                    name,
                    check_int(_fail, name, value, minimum=1, maximum=MAX_CACHE_CALLS),
                )
        if self.order is not None:
            store(self, "order", check_int(_fail, "order", self.order, minimum=1, maximum=2))
        if self.max_threshold is not None:
            assert self.threshold is not None  # first-block's default
            if self.max_threshold < self.threshold:
                _fail(
                    "max_threshold",
                    f"must be >= threshold {self.threshold:g}, got {self.max_threshold:g}",
                )

    @property
    def skips(self) -> bool:
        """Whether this policy caches at all (``kind`` is not ``"none"``)."""
        return self.kind != "none"


_POLICY_FIELDS = tuple(f.name for f in fields(StepCache) if f.name != "kind")


def parse_step_cache(value: object) -> StepCache | None:
    """A policy from text or a mapping, as the HTTP body and ``serve --cache`` give it.

    Text is ``KIND`` or ``KIND:THRESHOLD`` (``"first-block:0.1"``, ``"taylorseer"``,
    ``"none"``; for taylorseer the number is its ``interval``); a mapping holds
    ``StepCache``'s fields by name (``{"kind": "first-block", "threshold": 0.1}``).
    ``None`` stays ``None`` (the engine's default).

    Raises:
        InvalidRequestError: naming ``cache``.
    """
    if value is None or isinstance(value, StepCache):
        return value
    if isinstance(value, str):
        return _from_text(value)
    if isinstance(value, Mapping):
        unknown = sorted(ascii(key) for key in value if key not in _ALL_FIELDS)[:1]
        if unknown:
            _fail(unknown[0][:64], f"unknown; a policy takes {sorted(_ALL_FIELDS)}")
        if "kind" not in value:
            _fail("kind", "is required")
        return StepCache(**{str(key): item for key, item in value.items()})
    fail_request(
        "cache", f"must be a string 'KIND[:THRESHOLD]' or an object, got {type(value).__name__}"
    )


_ALL_FIELDS = frozenset(f.name for f in fields(StepCache))


def _from_text(text: str) -> StepCache:
    kind, colon, number = text.partition(":")
    if not colon:
        return StepCache(kind=kind)  # type: ignore[arg-type]
    try:
        parsed = float(number) if kind != "taylorseer" else int(number)
    except ValueError:
        what = "an interval (an integer)" if kind == "taylorseer" else "a threshold (a number)"
        _fail("text", f"after ':' comes {what}, got {number[:40]!r}")
    if isinstance(parsed, float) and not math.isfinite(parsed):
        _fail("threshold", f"must be finite, got {number[:40]!r}")
    if kind == "taylorseer":
        return StepCache(kind="taylorseer", interval=parsed)  # type: ignore[arg-type]
    return StepCache(kind=kind, threshold=parsed)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheMetrics:
    """What a request's step cache did (L84), in ``RequestMetrics.cache``.

    Counts are per row (an image of the request, and its guidance row) and model
    call: a step of a guided image is two row-calls. A skipped row-call ran the
    first block only; ``blocks_*`` count row-blocks.

    Args:
        kind: the policy's kind.
        calls_computed: row-calls that ran every block.
        calls_skipped: row-calls that ran the first block only (first-block) or
            none but the first (taylorseer) and took the cached or forecast rest.
        blocks_computed: row-blocks that ran.
        blocks_skipped: row-blocks that did not.
        threshold: the first-block threshold the request ended with; ``None`` for
            taylorseer.
        loosened: whether the engine raised the threshold to meet the deadline.
        pattern: per row, one character per model call: ``C`` computed, ``S``
            skipped (rows in the order of the model call: with guidance, the
            unguided rows first).
    """

    kind: str
    calls_computed: int
    calls_skipped: int
    blocks_computed: int
    blocks_skipped: int
    threshold: float | None = None
    loosened: bool = False
    pattern: tuple[str, ...] = ()

    @property
    def block_fraction(self) -> float:
        """The fraction of the row-blocks that ran (1.0 when none was counted)."""
        total = self.blocks_computed + self.blocks_skipped
        return 1.0 if total == 0 else self.blocks_computed / total


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCacheMetrics:
    """What a runner's prompt cache did for one request's texts (L94), in
    ``RequestMetrics.prompt_cache``.

    A text is a prompt or a negative prompt (``""`` for none), counted once per request
    whatever its number of images. ``encode_s`` is the text encoders' time for the
    misses (the host's wall time of the encode call: on CUDA its launches and what it
    waits for), ``saved_s`` the time the hits' entries took when they were computed.
    """

    hits: int = 0
    misses: int = 0
    encode_s: float = 0.0
    saved_s: float = 0.0
