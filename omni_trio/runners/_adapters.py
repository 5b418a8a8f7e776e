"""Adapters (LoRA) inside ``DiffusersRunner``'s model calls, row by row (L85-L87).

Loading: diffusers' own ``load_lora_weights`` puts an adapter into the pipeline's
LoRA-loadable components (the denoiser, and the text encoders where the file has
keys for them) as PEFT LoRA layers, under a name of the runner's own
(``omni_trio_<runner>_<load>``): two runners over one pipeline never collide, and
a reload after an eviction is a fresh load. A load is validated before its name is
published: every tensor of the source, whatever its format, lands on a layer of the
model (``_landing``'s census, before the model is touched, and its check after the
load), the layers are plain LoRA (``Linear`` or a convolution; DoRA and other
variants are refused) and none is fused; on any failure every layer of the new name
is deleted again, so nothing is half-loaded. Only ``.safetensors`` files are read (a
pickle is code). Once the runner is closed the pipeline is its owner's again, and a
load is refused.

Per-row forward: PEFT applies one set of adapters, with one scale each, to the
whole forward (``set_adapters``), and its mixed-batch path (``adapter_names``) one
adapter per row at the adapter's own scale. The runner needs more: each row its own
adapters, several per row, each with the request's scale. So every LoRA layer's
``forward`` is wrapped once (in the runner's ``ModuleHooks``, as the step cache wraps
its blocks, counted per module and put back by the last holder's ``close``): inside a
model call of the runner (the adapters' part of the call's context, ``_forward``) it
runs the base layer once over every row, then for each distinct ``(adapter, scale)`` of the call
adds ``lora_B(lora_A(dropout(x))) * alpha / r * scale`` on that pair's rows only
(``index_select`` / ``index_add_``; no indexing when the pair covers every row):
PEFT's own expressions, so a row equals the pipeline's own call with
``set_adapters([...], weights)`` up to batching's float noise. Outside the
runner's calls (no context) the layer is PEFT's, untouched: the pipeline's own
``__call__`` still works. The cost is one base forward plus each pair's low-rank
product on its rows; no weights are copied per scale.

The rows a layer sees: the denoiser's calls cover every row of the model call,
except inside the step cache's tail blocks where some rows skip (the context's
``computing`` says which compute, L81) and on a rank of a parallel group that runs a
slice of the call's rows (``_forward.rows_slice``), and the text encoders, which
``prepare`` runs for one request (every row is that request's: classifier-free
guidance's unconditional rows get its adapters too, as in diffusers). A layer that
sees a batch the context does not describe raises rather than guess. Pipelines with a
second denoiser (Wan 2.2's experts run row subsets of their own) take no adapters.

Residency (L87): ``AdapterSet`` bounds the loaded adapters by count and bytes. A
request holds its adapters from ``prepare`` to ``discard`` (running or suspended);
room for a load or a reload is made by evicting the least recently used adapters
that no request holds (their weights leave the model, their record and source
stay); the evictions are planned first, and when even evicting every unheld one
would not make room, none is evicted and the load is refused (``full``). A request
whose adapter was evicted while it waited reloads it in ``prepare``; when that
cannot be done (its file is gone, no room) ``prepare`` fails it with an
``AdapterError``: it never runs without it. An unload of an adapter that a request
holds is refused (``in-use``).

Text encoders (L94): a load records whether the adapter has a layer outside the
family's denoisers (``text_adapters`` picks those of a request's adapters: the prompt
cache's key), and every adapter whose weights leave the model is told to
``on_removed`` (the prompt cache drops what was encoded with it).

Threads: loads, unloads and evictions change the model's modules, so they take the
runner's model lock, which ``step`` and ``prepare`` hold around their model calls:
a load waits for the step under way and the next step waits for the load (decodes
run the VAE, which takes no LoRA, and never take it). The registry has a lock of
its own, never held across a model call: ``adapters()``, admission's
``names()`` and ``discard`` never wait for a step.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._adapters import AdapterError, AdapterInfo, AdapterPairs, check_adapter_name
from .._errors import InvalidRequestError
from ._forward import ModelCall, calling, current
from ._hooks import ModuleHooks, has_hook
from ._landing import Target, Unlanded, adapter_source, census, check_landed, source_tensors
from ._quiet import quiet_notices
from ._registry import family_class

__all__ = ["NAME", "AdapterSet", "HeldAdapters", "wrapped_layers"]

#: The adapters' name in a model call's parts, and their kind of hook (``_hooks``).
NAME = "adapters"

#: (the adapter's PEFT name, its scale) pairs a request's rows run with.
HeldAdapters = tuple[tuple[str, float], ...]

_serials = itertools.count()


def _fail(field: str, message: str) -> Any:
    raise InvalidRequestError(message, field=field)


# -- the per-call context -------------------------------------------------------------


class _Call:
    """The adapters' part of one model call (``_forward.CallPart``): each ``(PEFT name,
    scale)`` pair and the rows it covers.

    ``rows`` ``None``: every row of whatever batch a layer sees (a text encoder's call
    for one request).
    """

    __slots__ = ("_full", "device", "groups", "rows", "view", "view_groups")

    def __init__(
        self, groups: list[tuple[str, float, list[int]]], rows: int | None, device: torch.device
    ) -> None:
        self.groups = groups
        self.rows = rows
        self.device = device
        self._full: list[tuple[str, float, torch.Tensor | None]] | None = None
        self.view: list[int] | None = None
        self.view_groups: list[tuple[str, float, torch.Tensor | None]] = []

    def full(self) -> list[tuple[str, float, torch.Tensor | None]]:
        """The groups over every row of the call, made once per call."""
        if self._full is None:
            self._full = [
                (name, scale, self._index(rows, self.rows)) for name, scale, rows in self.groups
            ]
        return self._full

    def _index(self, rows: list[int], count: int | None) -> torch.Tensor | None:
        if count is None or len(rows) == count:
            return None  # every row: no indexing
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def of(self, batch: int) -> list[tuple[str, float, torch.Tensor | None]]:
        """The groups over the ``batch`` rows a layer sees now: positions in its tensors."""
        if self.rows is None:
            return [(name, scale, None) for name, scale, _ in self.groups]
        forward = current()
        view = None if forward is None else forward.computing
        if view is None:
            if batch != self.rows:
                raise RuntimeError(
                    f"adapters: a LoRA layer saw {batch} rows where the model call has {self.rows}"
                )
            return self.full()
        if batch != len(view):
            raise RuntimeError(f"adapters: a LoRA layer saw {batch} rows where {len(view)} compute")
        if self.view is not view:
            # Once per forward of the step cache's tail: the pairs' rows among the computing.
            position = {row: i for i, row in enumerate(view)}
            groups: list[tuple[str, float, torch.Tensor | None]] = []
            for name, scale, rows in self.groups:
                kept = [position[row] for row in rows if row in position]
                if kept:
                    groups.append((name, scale, self._index(kept, len(view))))
            self.view, self.view_groups = view, groups
        return self.view_groups

    def narrowed(self, low: int, high: int) -> _Call:
        """The call's rows ``low..high`` (a rank's slice of a call split by rows): each
        pair keeps its rows among them, counted from ``low``."""
        if self.rows is None:
            return self
        groups: list[tuple[str, float, list[int]]] = []
        for name, scale, rows in self.groups:
            kept = [row - low for row in rows if low <= row < high]
            if kept:
                groups.append((name, scale, kept))
        return _Call(groups, high - low, self.device)

    def exchange(self) -> None:
        """Nothing to exchange: every rank holds every adapter."""
        return None

    def commit(self) -> None:
        """Nothing to keep: a call changes no adapter."""


def _current() -> _Call | None:
    forward = current()
    part: _Call | None = None if forward is None else forward.part(NAME)
    return part


# -- the LoRA layers' forward ---------------------------------------------------------


def _scaling(layer: Any, name: str, scale: float) -> float:
    """PEFT's ``set_scale(name, scale)``: the scale times ``alpha / r`` (``sqrt(r)``: rsLoRA)."""
    rank = layer.r[name]
    if layer.use_rslora.get(name, False):
        rank = rank**0.5
    factor: float = scale * layer.lora_alpha[name] / rank
    return factor


def _lora_forward(
    self: Any, proceed: Any, x: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """A wrapped LoRA layer's ``forward`` (``proceed``: PEFT's): see the module doc."""
    call = _current()
    if call is None:
        out: torch.Tensor = proceed(x, *args, **kwargs)
        return out
    if self.merged:
        raise RuntimeError("adapters: a LoRA layer has fused (merged) weights; unfuse them")
    result: torch.Tensor = self.base_layer(x, *args, **kwargs)
    if not call.groups:
        return result
    dtype = result.dtype
    keys = self.lora_A.keys()
    for name, scale, index in call.of(x.shape[0]):
        if name not in keys:
            continue  # this adapter leaves the layer alone
        lora_a = self.lora_A[name]
        rows = x if index is None else x.index_select(0, index)
        rows = rows.to(lora_a.weight.dtype)
        delta = self.lora_B[name](lora_a(self.lora_dropout[name](rows)))
        delta = (delta * _scaling(self, name, scale)).to(dtype)
        if index is None:
            result = result + delta
        else:
            result.index_add_(0, index, delta)
    return result


def wrapped_layers(pipe: Any) -> int:
    """How many LoRA layers of ``pipe`` carry the runners' per-row forward now."""
    return sum(1 for _, module in _lora_modules(pipe, _components(pipe)) if has_hook(module, NAME))


def _components(pipe: Any) -> list[str]:
    names = getattr(pipe, "_lora_loadable_modules", ())
    return [name for name in names if isinstance(getattr(pipe, name, None), torch.nn.Module)]


def _takes_adapters(pipe: Any) -> bool:
    """Whether ``pipe``'s family takes adapters, diffusers loads them into it, and it has
    one denoiser (a second's rows, Wan 2.2's experts, are subsets of their own)."""
    family = family_class(pipe)
    if family is None or not family.takes_adapters:
        return False
    denoisers = [getattr(pipe, name, None) for name in family.denoisers]
    experts = [model for model in denoisers if isinstance(model, torch.nn.Module)]
    return callable(getattr(pipe, "load_lora_weights", None)) and len(experts) == 1


def _lora_modules(pipe: Any, components: Sequence[str]) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for component in components:
        for module in getattr(pipe, component).modules():
            if isinstance(module, LoraLayer):
                yield component, module


# -- the registry ---------------------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    """One named adapter: its source, and while loaded its PEFT name and bytes."""

    name: str
    path: Path | None
    state_dict: Mapping[str, Any] | None
    peft: str | None = None
    bytes: int = 0
    holders: int = 0
    used: int = 0

    def info(self) -> AdapterInfo:
        return AdapterInfo(
            name=self.name,
            bytes=self.bytes,
            holders=self.holders,
            loaded=self.peft is not None,
            source=None if self.path is None else str(self.path),
        )


@dataclass(eq=False)
class AdapterSet:
    """A runner's adapters: the registry, its bounds, the wrapped layers, each call's context.

    Args:
        pipe: the pipeline the adapters load into.
        model_lock: the runner's lock around its model calls (see the module doc).
        max_loaded: the most adapters loaded at once (L87).
        max_bytes: the most bytes of loaded adapters' weights, or ``None``.
        hooks: the runner's hooks, where the LoRA layers' wrappers are held.
    """

    pipe: Any
    model_lock: threading.RLock
    max_loaded: int
    max_bytes: int | None
    hooks: ModuleHooks
    supported: bool = field(init=False)
    #: Why a runner that could take adapters takes none (its compiled blocks, L93), or
    #: ``None``.
    refusal: str | None = None
    #: Called with an adapter's PEFT name once its weights left the model (an unload,
    #: an eviction, a load refused for room, the close), the model lock held: the
    #: prompt cache drops what it encoded with them (L94).
    on_removed: Callable[[str], None] | None = None
    _components: list[str] = field(init=False)
    #: The components that are not the family's denoisers: its text encoders.
    _text_components: frozenset[str] = field(init=False)
    #: The PEFT names of the loaded adapters with a layer in a text encoder.
    _text: set[str] = field(init=False, default_factory=set)
    _entries: dict[str, _Entry] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _layers: list[torch.nn.Module] = field(init=False, default_factory=list)
    _serial: int = field(init=False, default_factory=lambda: next(_serials))
    _loads: Iterator[int] = field(init=False, default_factory=itertools.count)
    _clock: Iterator[int] = field(init=False, default_factory=itertools.count)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"max_loaded_adapters: must be >= 1, got {self.max_loaded}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"max_adapter_bytes: must be >= 1 or None, got {self.max_bytes}")
        self._components = _components(self.pipe)
        family = family_class(self.pipe)
        denoisers = () if family is None else family.denoisers
        self._text_components = frozenset(c for c in self._components if c not in denoisers)
        self.supported = (
            bool(self._components) and _takes_adapters(self.pipe) and self.refusal is None
        )

    # -- what admission and the listings read (any thread, never waits for a step) ---

    def names(self) -> frozenset[str]:
        """The names requests may use: loaded, or evicted with a source to reload from."""
        with self._lock:
            return frozenset(self._entries)

    def infos(self) -> tuple[AdapterInfo, ...]:
        with self._lock:
            return tuple(self._entries[name].info() for name in sorted(self._entries))

    def text_adapters(self, held: HeldAdapters) -> HeldAdapters:
        """Those of ``held`` that touch a text encoder, in their order: what changes a
        request's text encoding (the prompt cache's key, L94)."""
        with self._lock:
            return tuple(pair for pair in held if pair[0] in self._text)

    # -- load, unload --------------------------------------------------------------

    def load(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load ``source`` as ``name`` (see ``AdapterRunner.load_adapter``)."""
        name = check_adapter_name(_fail, "name", name)
        if not self.supported:
            raise AdapterError(
                self.refusal or "this pipeline takes no adapters", reason="invalid", name=name
            )
        entry = _Entry(name, *adapter_source(name, source))
        with self.model_lock:
            if self._closed:
                # The pipeline is its owner's again: a load now would change its calls.
                raise AdapterError(
                    "the runner is closed: it loads nothing", reason="invalid", name=name
                )
            with self._lock:
                if name in self._entries:
                    raise AdapterError(
                        f"adapter {name!r} is loaded already; unload it first",
                        reason="exists",
                        name=name,
                    )
            self._inject(entry)
            with self._lock:
                self._entries[name] = entry
                entry.used = next(self._clock)
            self._make_room(keep=entry, drop_on_failure=True)

    def unload(self, name: str) -> None:
        """Unload ``name`` (see ``AdapterRunner.unload_adapter``)."""
        with self.model_lock:
            with self._lock:
                entry = self._entries.get(name)
                if entry is None:
                    raise AdapterError(
                        f"no adapter {name!r} is loaded", reason="unknown", name=name
                    )
                if entry.holders:
                    raise AdapterError(
                        f"adapter {name!r} is held by {entry.holders} live request(s);"
                        " unload it when they are done",
                        reason="in-use",
                        name=name,
                    )
                del self._entries[name]
            self._remove(entry)

    # -- the base LoRA (weights in place, L102) ------------------------------------

    def load_base(self, source: str | os.PathLike[str] | Mapping[str, Any]) -> object:
        """Load ``source`` as a LoRA that every row of every request runs at scale 1: a
        LoRA update of the weights (L102). Validated as a load is; never named, listed,
        held or evicted. Returns its handle, for ``base_pairs`` and ``remove_base``.

        Raises:
            AdapterError: not a LoRA this model takes (``invalid``), as ``load``.
        """
        if not self.supported:
            raise AdapterError(
                self.refusal or "this pipeline takes no adapters", reason="invalid", name="weights"
            )
        entry = _Entry("weights", *adapter_source("weights", source))
        with self.model_lock:
            if self._closed:
                raise AdapterError(
                    "the runner is closed: it loads nothing", reason="invalid", name="weights"
                )
            self._inject(entry)
        return entry

    @staticmethod
    def base_pairs(base: object | None) -> HeldAdapters:
        """The ``(PEFT name, scale)`` pair a request's rows run for the base LoRA ``base``."""
        if base is None:
            return ()
        assert isinstance(base, _Entry) and base.peft is not None
        return ((base.peft, 1.0),)

    def remove_base(self, base: object) -> None:
        """Take the base LoRA ``base`` (``load_base``'s) out of the model."""
        assert isinstance(base, _Entry)
        with self.model_lock:
            self._remove(base)

    def close(self) -> None:
        """Remove every adapter of this set from the pipeline and let go of the wrappers;
        later loads are refused."""
        with self.model_lock:
            self._closed = True
            with self._lock:
                entries = list(self._entries.values())
                self._entries.clear()
            for entry in entries:
                with suppress(Exception):
                    self._remove(entry)
            self._layers = []  # their wrappers go with the runner's hooks

    # -- holds (prepare, discard) ---------------------------------------------------

    def acquire(self, pairs: AdapterPairs) -> HeldAdapters:
        """Hold a request's adapters for its life, reloading evicted ones (L85, L87).

        Called with the model lock held (``prepare``).

        Raises:
            AdapterError: an adapter was unloaded after admission, or could not be
                reloaded; the request holds nothing then.
        """
        held: list[_Entry] = []
        resolved: list[tuple[str, float]] = []
        try:
            for name, scale in pairs:
                with self._lock:
                    entry = self._entries.get(name)
                    if entry is None:
                        raise AdapterError(
                            f"adapter {name!r} was unloaded after the request was admitted",
                            reason="unknown",
                            name=name,
                        )
                    entry.holders += 1
                    held.append(entry)
                if entry.peft is None:
                    self._inject(entry)
                    self._make_room(keep=entry, drop_on_failure=False)
                assert entry.peft is not None
                resolved.append((entry.peft, scale))
        except BaseException:
            self.release_entries(held)
            raise
        return tuple(resolved)

    def release(self, pairs: AdapterPairs) -> None:
        """Let go of a request's adapters (``discard``): they become evictable."""
        with self._lock:
            entries = [self._entries[name] for name, _ in pairs if name in self._entries]
        self.release_entries(entries)

    def release_entries(self, entries: Sequence[_Entry]) -> None:
        with self._lock:
            for entry in entries:
                entry.holders -= 1
                entry.used = next(self._clock)

    # -- a model call's context -----------------------------------------------------

    def part(self, call: ModelCall) -> _Call | None:
        """The adapters' part of ``call``: each state's rows run its held adapters
        (``state.adapters``); ``None`` while no layer is wrapped."""
        if not self._layers:
            return None
        groups: dict[tuple[str, float], list[int]] = {}
        for state, start, count in call.owners():
            for pair in state.adapters:
                groups.setdefault(pair, []).extend(range(start, start + count))
        listed = [(name, scale, members) for (name, scale), members in groups.items()]
        return _Call(listed, call.total, call.device)

    @contextmanager
    def every_row(self, held: HeldAdapters) -> Iterator[None]:
        """Inside, every row of every call runs ``held``'s adapters (a request's text encoding)."""
        if not self._layers:
            yield
            return
        listed: list[tuple[str, float, list[int]]] = [(name, scale, []) for name, scale in held]
        with calling(None, {NAME: _Call(listed, None, torch.device(self.pipe.device))}):
            yield

    # -- inside the model lock ------------------------------------------------------

    def _inject(self, entry: _Entry) -> None:
        """Load ``entry`` under a fresh PEFT name, validated; on failure nothing stays."""
        peft = f"omni_trio_{self._serial}_{next(self._loads)}"
        if entry.path is not None and not entry.path.is_file():
            raise AdapterError(
                f"adapter {entry.name!r}: its file {entry.path} is gone",
                reason="invalid",
                name=entry.name,
            )
        try:
            with quiet_notices(), torch.no_grad(), _peft_notes():
                # Where every tensor lands, checked before the model is touched.
                landing = census(
                    self.pipe,
                    self._components,
                    source_tensors(entry.name, entry.path, entry.state_dict),
                )
                if entry.path is not None:
                    self.pipe.load_lora_weights(
                        str(entry.path.parent), weight_name=entry.path.name, adapter_name=peft
                    )
                else:
                    assert entry.state_dict is not None
                    self.pipe.load_lora_weights(dict(entry.state_dict), adapter_name=peft)
            layers, size, components = self._check_loaded(entry.name, peft, landing)
        except Exception as exc:
            with suppress(Exception):
                self._delete(peft)
            if isinstance(exc, AdapterError):
                raise
            if isinstance(exc, Unlanded):
                raise AdapterError(
                    f"adapter {entry.name!r}: {exc}", reason="invalid", name=entry.name
                ) from None
            raise AdapterError(
                f"adapter {entry.name!r}: not a LoRA this model takes"
                f" ({type(exc).__name__}: {exc})",
                reason="invalid",
                name=entry.name,
            ) from exc
        known = set(map(id, self._layers))
        for layer in layers:
            if id(layer) not in known:
                self.hooks.wrap(layer, NAME, _lora_forward)
                self._layers.append(layer)
        entry.peft, entry.bytes = peft, size
        if components & self._text_components:
            with self._lock:
                self._text.add(peft)

    def _check_loaded(
        self, name: str, peft: str, landing: Mapping[str, Target]
    ) -> tuple[list[torch.nn.Module], int, frozenset[str]]:
        """The layers the load reached, its bytes and the components they are in;
        ``AdapterError`` if it is not plain LoRA, ``Unlanded`` if a tensor of it did not
        land (``check_landed``)."""
        from peft.tuners.lora import Conv2d, Conv3d, Linear
        from peft.tuners.lora.torchao import TorchaoLoraLinear

        def invalid(message: str) -> AdapterError:
            return AdapterError(f"adapter {name!r}: {message}", reason="invalid", name=name)

        layers: list[torch.nn.Module] = []
        components: set[str] = set()
        size = 0
        for component, layer in _lora_modules(self.pipe, self._components):
            if peft not in layer.lora_A:
                continue
            components.add(component)
            # A torchao-quantized base layer runs per row as any (``_quantize``); not
            # bitsandbytes' or another kind's.
            if type(layer) not in (Linear, TorchaoLoraLinear, Conv2d, Conv3d):
                raise invalid(f"a LoRA of a {type(layer).__name__} layer is not applied per row")
            if peft in layer.lora_variant or layer.use_dora.get(peft, False):
                raise invalid("DoRA and other LoRA variants are not applied per row")
            if layer.merged:
                raise invalid("the model has fused (merged) LoRA weights; unfuse them first")
            for module in (layer.lora_A[peft], layer.lora_B[peft]):
                size += sum(parameter.nbytes for parameter in module.parameters())
            layers.append(layer)
        if not layers:
            raise invalid("it changes no layer of this model")
        check_landed(self.pipe, self._components, landing, peft)
        return layers, size, frozenset(components)

    def _make_room(self, *, keep: _Entry, drop_on_failure: bool) -> None:
        """Evict the least recently used unheld adapters until the bounds hold (L87).

        Planned first: when evicting every unheld one would not make room, nothing is
        evicted and ``keep`` leaves the model again (``full``).
        """
        victims: list[_Entry] = []
        with self._lock:
            loaded = [e for e in self._entries.values() if e.peft is not None]
            count = len(loaded)
            size = sum(e.bytes for e in loaded)
            for entry in sorted(loaded, key=lambda e: e.used):
                if not self._over(count, size):
                    break
                if entry is keep or entry.holders:
                    continue
                victims.append(entry)
                count -= 1
                size -= entry.bytes
            full = self._over(count, size)
            if full and drop_on_failure:
                del self._entries[keep.name]
        if full:
            self._remove(keep)
            raise AdapterError(
                f"adapter {keep.name!r}: no room among the loaded adapters"
                f" (at most {self.max_loaded}"
                + ("" if self.max_bytes is None else f", {self.max_bytes} bytes")
                + (
                    ") while live requests hold the others"
                    if self.max_bytes is None or keep.bytes <= self.max_bytes
                    else f"; it alone has {keep.bytes})"
                ),
                reason="full",
                name=keep.name,
            )
        for entry in victims:
            self._remove(entry)

    def _over(self, count: int, size: int) -> bool:
        return count > self.max_loaded or (self.max_bytes is not None and size > self.max_bytes)

    def _remove(self, entry: _Entry) -> None:
        """Take ``entry``'s weights out of the model; its record stays (an eviction)."""
        peft, entry.peft, entry.bytes = entry.peft, None, 0
        if peft is not None:
            with self._lock:
                self._text.discard(peft)
            try:
                self._delete(peft)
            finally:
                if self.on_removed is not None:
                    self.on_removed(peft)

    def _delete(self, peft: str) -> None:
        with _peft_notes():
            for _, layer in _lora_modules(self.pipe, self._components):
                if peft in layer.lora_A:
                    layer.delete_adapter(peft)
        for component in self._components:
            config = getattr(getattr(self.pipe, component), "peft_config", None)
            if isinstance(config, dict):
                config.pop(peft, None)


@contextmanager
def _peft_notes() -> Iterator[None]:
    """Drop PEFT's three notes on what the runner does on purpose: several adapters in one
    model, deleting the one PEFT had active (the runner never reads PEFT's active set),
    and a LoRA on a torchao layer that cannot merge (the runner never merges: a fused
    layer is refused). Under the model lock; ``catch_warnings`` restores the filters it
    found."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated without", UserWarning)
        warnings.filterwarnings(
            "ignore", r"Adapter \S+ was active which is now deleted", UserWarning
        )
        yield
