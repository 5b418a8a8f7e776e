"""Adapters (LoRA): what a request names, what a runner reports (L85-L88).

A request names the adapters it wants with a scale each (``GenerationRequest.adapters``,
stored as a tuple of ``(name, scale)`` pairs, in the order given); a runner that
declares ``RunnerCapabilities.max_adapters`` loads adapters by name
(``AdapterRunner``) and reports them as ``AdapterInfo``. ``check_adapter_pairs`` is
the request's own check; the engine refuses at admission a name that no runner has
(``unknown_adapters``, L4). Loads and unloads that cannot be done raise
``AdapterError``, whose ``reason`` says why.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ._errors import OmniTrioError
from ._validate import Fail, check_float

__all__ = [
    "ADAPTER_NAME",
    "MAX_ADAPTER_SCALE",
    "AdapterError",
    "AdapterInfo",
    "AdapterPairs",
    "AdapterReason",
    "check_adapter_name",
    "check_adapter_pairs",
    "unknown_adapters",
]

#: A request's adapters as stored: ``(name, scale)`` pairs, in the order given.
AdapterPairs: TypeAlias = tuple[tuple[str, float], ...]

#: An adapter's name: a letter or digit, then letters, digits, ``_``, ``.`` or ``-``;
#: 64 characters at most (it goes into URLs, logs and metric labels as it is).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")

#: The largest ``abs(scale)`` of an adapter accepted: LoRA scales are used from 0 to
#: about 2; larger ones only make the model's activations overflow.
MAX_ADAPTER_SCALE = 100.0

#: Why a load or unload was refused: a source that is not a LoRA for this model, a
#: tensor of which lands on no layer, or a runner that is closed (``invalid``), a
#: name that is not loaded (``unknown``) or is already (``exists``), an adapter that
#: live requests hold or whose load or unload is in flight (``in-use``), no room
#: within the bounds of loaded adapters even after evicting every one that no request
#: holds (``full``: then none is evicted).
AdapterReason: TypeAlias = Literal["invalid", "unknown", "exists", "in-use", "full"]


class AdapterError(OmniTrioError):
    """An adapter could not be loaded, reloaded or unloaded; ``reason`` says why."""

    def __init__(self, message: str, *, reason: AdapterReason, name: str) -> None:
        super().__init__(message)
        self.reason: AdapterReason = reason
        self.name = name

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (str(self), self.reason, self.name))


def _rebuilt(message: str, reason: AdapterReason, name: str) -> AdapterError:
    return AdapterError(message, reason=reason, name=name)


@dataclass(frozen=True, slots=True, kw_only=True)
class AdapterInfo:
    """One adapter a runner knows (L85, L87).

    Args:
        name: the name requests use.
        bytes: its weights' bytes in the model while loaded (0 while evicted).
        holders: the live requests (prepared, running or suspended) that hold it.
        loaded: whether its weights are in the model now; ``False`` once evicted
            (L87): the next request that names it reloads it from ``source``.
        source: the file it was loaded from, or ``None`` for a state dict (kept by
            reference, for a reload).
    """

    name: str
    bytes: int
    holders: int
    loaded: bool
    source: str | None


def check_adapter_name(fail: Fail, field: str, name: object) -> str:
    """Return ``name`` if it is an adapter name (``ADAPTER_NAME``), else fail naming ``field``."""
    if not isinstance(name, str):
        fail(field, f"an adapter's name must be a str, got {type(name).__name__}")
    if ADAPTER_NAME.fullmatch(name) is None:
        shown = name if len(name) <= 80 else name[:77] + "..."
        fail(
            field,
            f"{shown!r} is not an adapter name (a letter or digit, then letters, digits,"
            " '_', '.' or '-'; at most 64 characters)",
        )
    return str(name)


def check_adapter_pairs(fail: Fail, value: object) -> AdapterPairs:
    """``GenerationRequest.adapters`` as stored: a mapping, or pairs, of name to scale.

    Names valid and unique, scales finite numbers of at most ``MAX_ADAPTER_SCALE``
    in absolute value. Read once: a caller changing its mapping later changes nothing.
    """
    items: list[tuple[object, object]]
    if isinstance(value, Mapping):
        try:
            items = list(value.items())
        except Exception as exc:  # a hostile mapping: refuse it, do not crash
            fail("adapters", f"could not be read ({type(exc).__name__})")
    elif isinstance(value, tuple | list):
        items = []
        for pair in value:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                fail("adapters", "must map names to scales: a mapping, or (name, scale) pairs")
            items.append((pair[0], pair[1]))
    else:
        fail("adapters", f"must map names to scales, got {type(value).__name__}")
    pairs: list[tuple[str, float]] = []
    seen: set[str] = set()
    for name, scale in items:
        name = check_adapter_name(fail, "adapters", name)
        if name in seen:
            fail("adapters", f"names {name!r} twice")
        seen.add(name)
        number = check_float(
            fail, "adapters", scale, minimum=-MAX_ADAPTER_SCALE, maximum=MAX_ADAPTER_SCALE
        )
        assert math.isfinite(number)
        pairs.append((name, number))
    return tuple(pairs)


def unknown_adapters(names: Iterable[str], known: Iterable[frozenset[str]]) -> list[str]:
    """The ``names`` that some runner does not know (each runner's names in ``known``)."""
    sets = list(known)
    return [name for name in names if any(name not in names_of for names_of in sets)]
