"""A runner's prompt-embedding cache (L94): one text's encoding, kept for the next request.

Traffic repeats itself: the same negative prompt on every request, templated prompts,
retries. A ``DiffusersRunner`` keeps what its family's text encoding returned for one
text and one image (prompt embeddings, pooled embeddings, attention masks, text ids:
whatever the family's encode returns, under its own names), so that the next request
with that text skips the text encoders.

The key is everything that changes the encoding:

- the text;
- the family's encoding (its class, its encode function and its
  ``max_sequence_length`` where it has one: ``Family._encoded``);
- the pipeline's text encoders and tokenizers (its components named ``text_encoder*``
  and ``tokenizer*``): which objects they are, each encoder's dtype and device (its
  first parameter's), and the device the family encodes for;
- the request's adapters that touch a text encoder (``AdapterSet.text_adapters``), with
  their scales, in the request's order (a LoRA layer adds them in that order). An
  adapter of the denoiser alone leaves the encoding as it is and is not in the key.

Per text, not per pair of prompts: the families encode a negative prompt with the same
call as a prompt (the pipelines compute the two alike), so a negative prompt shared by
requests with different prompts is encoded once. Per image: an entry is the encoding
for one image; a request of N images repeats it N times (``Family``'s ``per_image``),
as ``num_images_per_prompt`` repeats its one encoding.

Bound: ``max_bytes`` bytes of kept tensors (and their texts), the least recently used
entry out first; an entry larger than the bound is not kept; 0 keeps nothing.

Never shared by reference: a miss keeps a copy of what it computed and hands the
computed tensors on; a hit hands out copies of the kept ones. Nothing a request does
with its tensors (parking them, an in-place op) reaches the cache, and a hit equals
the computed encoding bitwise.

Invalidation: an adapter that touches a text encoder leaving the model (unloaded,
evicted, a load that failed, the runner closing) drops every entry keyed with it; its
PEFT name is never used again (a reload is a fresh name, so a fresh key). ``clear()``
drops everything, for a change of the weights that the runner does not make itself;
``close()`` frees the cache for good.

Where it runs: the runner's ``prepare`` sets a request's scope (``PromptCache.scope``:
the key's encoders and adapters, the request's counts) in a thread-local, as the model
call's context is set (``_forward``); a family's encoding reads it (``encoded``), and
without a scope it encodes as if there were no cache. Lookups run with the runner's
model lock held, drops come from loads and unloads (which hold it too), statistics
from any thread: the table has a lock of its own, never held across an encode. What a
request's scope counted (``PromptScope.metrics``, a ``PromptCacheMetrics``) stays with
its state, for the runner's ``prompt_cache_metrics``: the engine reads it before the
discard into ``RequestMetrics.prompt_cache``.

Runners over one pipeline (several workers, L42) share its tokenizers, and a tokenizer
is not safe in two threads at once: a call of transformers' fast tokenizers sets its
padding and truncation on the tokenizer itself before it encodes, and diffusers'
``encode_prompt`` tokenizes a text twice, padded to the model's length and then to the
longest, so another thread's call in between padded a prompt's T5 tokens to their own
count (10 instead of 512 on tiny Flux) and the image came out of another worker's. So
every encode holds the locks of the pipeline's tokenizers (``tokenizers_held``: one per
tokenizer, whatever runners or pipelines share it), as every decode holds the VAE's.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .._stepcache import PromptCacheMetrics
from ._locks import object_lock as tokenizer_lock

__all__ = [
    "PROMPT_CACHE_BYTES",
    "Encoded",
    "PromptCache",
    "PromptCacheMetrics",
    "PromptCacheStatistics",
    "PromptScope",
    "encoded",
    "tokenizer_lock",
    "tokenizers_held",
]

#: The default bound: 64 MiB. An entry is one text's encoding for one image: about
#: 0.3 MB for SDXL (77 x 2,048 in float16), 2.7 MB for SD3, 4.2 MB for Flux and Wan
#: (512 T5 tokens x 4,096 in bfloat16). So it keeps the few negative prompts and hot
#: prompts of a server (15 Flux texts, 200 SDXL ones) in 0.3 % of a 24 GB card.
PROMPT_CACHE_BYTES = 64 * 2**20

#: One text's encoding for one image, by the family's names for its tensors.
Encoded = Mapping[str, torch.Tensor]

#: The components whose objects are in the key.
_TEXT_COMPONENTS = ("text_encoder", "tokenizer")


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptCacheStatistics:
    """A runner's prompt cache at one moment (``DiffusersRunner.prompt_cache_statistics``).

    ``hits``, ``misses``, ``encode_s`` and ``saved_s`` are summed over the runner's life
    (a request's own are its ``PromptCacheMetrics``); ``evictions`` counts entries the
    bound put out, ``dropped`` those an adapter's removal or ``clear()`` invalidated;
    ``entries`` and ``bytes`` are what it holds now, of at most ``max_bytes``.
    """

    hits: int
    misses: int
    evictions: int
    dropped: int
    entries: int
    bytes: int
    max_bytes: int
    encode_s: float
    saved_s: float


@dataclass(eq=False, slots=True)
class _Entry:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    encode_s: float
    adapters: frozenset[str]


def _kept(tensors: Encoded) -> tuple[dict[str, torch.Tensor], int]:
    """Copies of ``tensors`` for the table, and their bytes (each copy its own storage)."""
    kept = {name: tensor.detach().clone() for name, tensor in tensors.items()}
    return kept, sum(tensor.untyped_storage().nbytes() for tensor in kept.values())


class PromptCache:
    """One runner's table of encodings, bounded in bytes (see the module doc).

    Args:
        pipe: the runner's pipeline (its text encoders and tokenizers are read for
            the key at each request).
        max_bytes: the bound; 0 keeps nothing.

    Raises:
        ValueError: ``max_bytes`` is negative.
    """

    def __init__(self, pipe: Any, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prompt_cache_bytes: must be an int >= 0, got {max_bytes!r}")
        self._pipe = pipe
        components = getattr(pipe, "components", None)
        names = components if isinstance(components, Mapping) else {}
        self._components = tuple(name for name in names if name.startswith(_TEXT_COMPONENTS))
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._by_adapter: dict[str, set[Hashable]] = {}
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._dropped = 0
        self._encode_s = self._saved_s = 0.0
        # Which object a component is, by a number of its own: an id could be reused by
        # a new object once the old one is gone.
        self._identities: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._serials = itertools.count()

    @property
    def enabled(self) -> bool:
        """Whether it keeps entries (a bound above 0, not closed)."""
        return self._max_bytes > 0

    # -- a request's scope ----------------------------------------------------------

    @contextmanager
    def scope(self, adapters: Sequence[tuple[str, float]], device: Any) -> Iterator[PromptScope]:
        """Inside, this thread's encodings go through the cache for one request.

        ``adapters``: the request's held adapters that touch a text encoder (PEFT name,
        scale), in its order; ``device``: the device the family encodes for.
        """
        scope = PromptScope(self, tuple(adapters), device)
        saved = getattr(_local, "scope", None)
        _local.scope = scope
        try:
            yield scope
        finally:
            _local.scope = saved

    def _encoders(self, device: Any) -> Hashable:
        """The key's part for the text encoders and tokenizers: which, in what dtype, where."""
        parts: list[Hashable] = [str(device)]
        for name in self._components:
            component = getattr(self._pipe, name, None)
            if component is None:
                parts.append((name, None))
                continue
            where: Hashable = None
            if isinstance(component, torch.nn.Module):
                first = next(iter(component.parameters()), None)
                if first is not None:
                    where = (first.dtype, str(first.device))
            parts.append((name, self._identity(component), where))
        return tuple(parts)

    def _identity(self, component: Any) -> Hashable:
        try:
            serial = self._identities.get(component)
            if serial is None:
                serial = self._identities[component] = next(self._serials)
        except TypeError:  # an object that takes no weak reference: its id, while it lives
            return ("id", id(component))
        return serial

    # -- the table --------------------------------------------------------------------

    def _get(self, key: Hashable) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            self._saved_s += entry.encode_s
            return entry

    def _put(
        self,
        key: Hashable,
        text: str,
        tensors: Encoded,
        seconds: float,
        adapters: Sequence[tuple[str, float]],
    ) -> None:
        kept, size = _kept(tensors)
        size += sys.getsizeof(text)
        entry = _Entry(kept, size, seconds, frozenset(name for name, _ in adapters))
        with self._lock:
            self._encode_s += seconds
            if size > self._max_bytes:
                return  # larger than the bound (or the cache closed since the miss)
            self._remove(key)
            while self._bytes + size > self._max_bytes:
                oldest = next(iter(self._entries))
                self._remove(oldest)
                self._evictions += 1
            self._entries[key] = entry
            self._bytes += size
            for name in entry.adapters:
                self._by_adapter.setdefault(name, set()).add(key)

    def _missed(self, seconds: float) -> None:
        with self._lock:
            self._misses += 1
            self._encode_s += seconds

    def _remove(self, key: Hashable) -> bool:
        """Take ``key``'s entry out (the lock held); whether there was one."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.nbytes
        for name in entry.adapters:
            keys = self._by_adapter.get(name)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_adapter[name]
        return True

    # -- invalidation ---------------------------------------------------------------

    def drop_adapter(self, peft: str) -> None:
        """Drop every entry keyed with the adapter ``peft`` (its weights left the model)."""
        with self._lock:
            for key in list(self._by_adapter.get(peft, ())):
                if self._remove(key):
                    self._dropped += 1

    def clear(self) -> None:
        """Drop every entry: the weights changed in a way the runner did not see."""
        with self._lock:
            self._dropped += len(self._entries)
            self._entries.clear()
            self._by_adapter.clear()
            self._bytes = 0

    def close(self) -> None:
        """Drop every entry and keep none from now on (the runner closes)."""
        self.clear()
        with self._lock:
            self._max_bytes = 0

    def statistics(self) -> PromptCacheStatistics:
        """Its counts and what it holds now."""
        with self._lock:
            return PromptCacheStatistics(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                dropped=self._dropped,
                entries=len(self._entries),
                bytes=self._bytes,
                max_bytes=self._max_bytes,
                encode_s=self._encode_s,
                saved_s=self._saved_s,
            )


@dataclass(eq=False)
class PromptScope:
    """One request's encodings through a ``PromptCache``: its part of the key, its counts."""

    cache: PromptCache
    adapters: tuple[tuple[str, float], ...]
    device: Any
    hits: int = 0
    misses: int = 0
    encode_s: float = 0.0
    saved_s: float = 0.0
    _base: Hashable = field(default=None, repr=False)

    def encoded(
        self, family: Hashable, text: str, encode: Callable[[str], Encoded]
    ) -> dict[str, torch.Tensor]:
        """``encode(text)``, or a copy of the entry that holds it (see ``encoded``)."""
        cache = self.cache
        if not cache.enabled:
            tensors, seconds = _timed(encode, text)
            cache._missed(seconds)
            self._count(miss=seconds)
            return tensors
        if self._base is None:  # once per request: its texts share it
            self._base = (cache._encoders(self.device), self.adapters)
        key = (self._base, family, text)
        entry = cache._get(key)
        if entry is not None:
            self._count(hit=entry.encode_s)
            return {name: tensor.clone() for name, tensor in entry.tensors.items()}
        tensors, seconds = _timed(encode, text)
        cache._put(key, text, tensors, seconds, self.adapters)
        self._count(miss=seconds)
        return tensors

    def _count(self, *, hit: float | None = None, miss: float | None = None) -> None:
        if hit is not None:
            self.hits += 1
            self.saved_s += hit
        if miss is not None:
            self.misses += 1
            self.encode_s += miss

    def metrics(self) -> PromptCacheMetrics:
        """What the cache did for the request's texts."""
        return PromptCacheMetrics(
            hits=self.hits, misses=self.misses, encode_s=self.encode_s, saved_s=self.saved_s
        )


def _timed(encode: Callable[[str], Encoded], text: str) -> tuple[dict[str, torch.Tensor], float]:
    start = time.perf_counter()
    tensors = dict(encode(text))
    return tensors, time.perf_counter() - start


_local = threading.local()


def encoded(
    family: Hashable, text: str, encode: Callable[[str], Encoded]
) -> dict[str, torch.Tensor]:
    """``encode(text)`` through the prompt cache of the request under way in this thread.

    ``family``: the key's part for the family's encoding (its class, its encode
    function, its parameters). Without a scope (a family used outside a runner's
    ``prepare``), ``encode(text)`` itself. The tensors returned are the caller's own:
    freshly computed, or copies of the cache's.
    """
    scope: PromptScope | None = getattr(_local, "scope", None)
    if scope is None:
        return dict(encode(text))
    return scope.encoded(family, text, encode)


@contextmanager
def tokenizers_held(pipe: Any) -> Iterator[None]:
    """Inside, this thread holds the locks of ``pipe``'s tokenizers (its components named
    ``tokenizer*``), taken in one order in every thread: no other runner tokenizes with
    them (see the module doc)."""
    components = getattr(pipe, "components", None)
    named = components if isinstance(components, Mapping) else {}
    found = {
        id(component): component
        for name, component in named.items()
        if name.startswith("tokenizer") and component is not None
    }
    with ExitStack() as stack:
        for key in sorted(found):
            stack.enter_context(tokenizer_lock(found[key]))
        yield
