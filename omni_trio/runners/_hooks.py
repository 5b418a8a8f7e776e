"""One registry of the runners' hooks on torch modules: a chain per module, counted, one close.

Four features hook the modules a model call runs through: cancel points (a forward
pre-hook before every block, L71), the step cache (its blocks' ``forward`` wrapped,
L80), adapters (every LoRA layer's ``forward`` wrapped, L85) and the row-invariant
layers of sampled requests (every linear and convolution layer's, L100). Several
runners may share one pipeline. So a hook is installed once per module and kind however many
runners hold it, counted, and removed by its last holder's ``close``; each runner
holds its hooks in one ``ModuleHooks`` and lets go of all of them at once.

A wrapped ``forward`` is one chain per module: the module's own ``forward`` (its
class's, or one a library set on the instance, put back when the last wrapper goes)
and the wrappers in the order of their kinds (``ORDER``), the first outermost. The
chain lives on the module (an instance attribute and a bound method), so a deep copy
of the module copies it and calls its own. A wrapper is called as
``wrapper(module, proceed, *args, **kwargs)``, ``proceed`` calling the rest of the
chain. Pre-hooks are torch's own (``register_forward_pre_hook``): they run before the
chain, so a cancel point comes before any wrapper's work, on a skipped block too.

Threads: installing and removing take one lock; calls read the chain without it (a
module is changed only while no model call runs: at construction and ``close``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["COMPILED", "ORDER", "ModuleHooks", "Wrapper", "has_hook"]

#: A wrapper of a module's ``forward``: ``(module, proceed, *args, **kwargs)``.
Wrapper = Callable[..., Any]

#: The kinds of wrapper, outermost first.
ORDER = ("step-cache", "adapters", "row-invariant")

#: The kind of the replacement of a module's own forward by its compiled one (L90).
COMPILED = "compiled"

_CHAIN = "_omni_trio_chain"


@dataclass(eq=False, slots=True)
class _Chain:
    """A module's wrapped ``forward``: the one that was there, and the wrappers by kind."""

    original: Any
    #: An instance ``forward`` that was there before ours (a library's), to put back.
    instance_forward: Any
    wrappers: dict[str, Wrapper] = field(default_factory=dict)
    ordered: tuple[Wrapper, ...] = ()
    #: What runs in the original's place, where a holder replaced it (``replace``: a
    #: compiled forward, L90), or ``None``.
    inner: Any = None

    def order(self) -> None:
        self.ordered = tuple(self.wrappers[kind] for kind in ORDER if kind in self.wrappers)

    @property
    def innermost(self) -> Callable[..., Any]:
        run: Callable[..., Any] = self.original if self.inner is None else self.inner
        return run

    @property
    def empty(self) -> bool:
        return not self.wrappers and self.inner is None


def _proceed(module: torch.nn.Module, chain: _Chain, depth: int) -> Callable[..., Any]:
    if depth == len(chain.ordered):
        return chain.innermost

    def proceed(*args: Any, **kwargs: Any) -> Any:
        return chain.ordered[depth](module, _proceed(module, chain, depth + 1), *args, **kwargs)

    return proceed


def _chained_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``forward`` of a module with wrappers: the first wrapper, given the rest."""
    chain: _Chain = self.__dict__[_CHAIN]
    if not chain.ordered:
        return chain.innermost(*args, **kwargs)
    return chain.ordered[0](self, _proceed(self, chain, 1), *args, **kwargs)


_lock = threading.Lock()
# (module, kind) -> [how many ModuleHooks hold it, the torch handle of a pre-hook or None]
_held: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, list[Any]]] = (
    weakref.WeakKeyDictionary()
)


class ModuleHooks:
    """One runner's hooks; see the module's docstring."""

    def __init__(self) -> None:
        self._mine: list[tuple[torch.nn.Module, str]] = []

    def pre_hook(
        self, modules: Iterable[torch.nn.Module], kind: str, hook: Callable[..., Any]
    ) -> None:
        """Hold a forward pre-hook of ``kind`` on each of ``modules`` (each module once)."""
        unique = {id(module): module for module in modules}
        with _lock:
            for module in unique.values():
                if self._hold(module, kind):
                    _held[module][kind][1] = module.register_forward_pre_hook(hook)

    def wrap(self, module: torch.nn.Module, kind: str, wrapper: Wrapper) -> bool:
        """Hold ``wrapper`` of ``kind`` around ``module``'s ``forward``; return whether this
        call installed it (``False``: another holder had, and it stays that one)."""
        assert kind in ORDER, kind
        with _lock:
            if not self._hold(module, kind):
                return False
            chain = _chain_of(module)
            chain.wrappers[kind] = wrapper
            chain.order()
            return True

    def replace(
        self, module: torch.nn.Module, kind: str, make: Callable[[Callable[..., Any]], Any]
    ) -> bool:
        """Hold ``make(forward)`` in place of ``module``'s own ``forward``, innermost of its
        chain (its wrappers and pre-hooks stay outside: a compiled block, L90); return
        whether this call installed it."""
        with _lock:
            if not self._hold(module, kind):
                return False
            chain = _chain_of(module)
            assert chain.inner is None, "one replacement of a module's forward at a time"
            chain.inner = make(chain.original)
            return True

    def _hold(self, module: torch.nn.Module, kind: str) -> bool:
        """Count one more holder of ``(module, kind)``; return whether it is the first."""
        self._mine.append((module, kind))
        kinds = _held.setdefault(module, {})
        entry = kinds.get(kind)
        if entry is not None:
            entry[0] += 1
            return False
        kinds[kind] = [1, None]
        return True

    @property
    def count(self) -> int:
        """How many (module, kind) hooks this runner holds (0 once closed)."""
        return len(self._mine)

    def modules(self, kind: str) -> list[torch.nn.Module]:
        """The modules this runner holds a hook of ``kind`` on."""
        return [module for module, held in self._mine if held == kind]

    def close(self) -> None:
        """Let go of every hook; the last holder of one removes it. Idempotent."""
        mine, self._mine = self._mine, []
        with _lock:
            for module, kind in mine:
                kinds = _held.get(module)
                entry = None if kinds is None else kinds.get(kind)
                if entry is None:
                    continue
                entry[0] -= 1
                if entry[0]:
                    continue
                del kinds[kind]  # type: ignore[union-attr]
                if not kinds:
                    _held.pop(module, None)
                if entry[1] is not None:
                    entry[1].remove()
                else:
                    _unwrap(module, kind)


def _chain_of(module: torch.nn.Module) -> _Chain:
    """``module``'s chain, made (and its ``forward`` put through it) if it has none."""
    chain: _Chain | None = module.__dict__.get(_CHAIN)
    if chain is None:
        chain = _Chain(module.forward, module.__dict__.get("forward"))
        module.__dict__[_CHAIN] = chain
        # A bound method, so a deep copy of the module rebinds it to the copy.
        module.__dict__["forward"] = _chained_forward.__get__(module)
    return chain


def _unwrap(module: torch.nn.Module, kind: str) -> None:
    chain: _Chain | None = module.__dict__.get(_CHAIN)
    if chain is None:
        return
    if kind in chain.wrappers:
        chain.wrappers.pop(kind)
        chain.order()
    else:
        chain.inner = None  # the replacement's kind
    if not chain.empty:
        return
    del module.__dict__[_CHAIN]
    del module.__dict__["forward"]
    if chain.instance_forward is not None:
        module.__dict__["forward"] = chain.instance_forward


def has_hook(module: torch.nn.Module, kind: str) -> bool:
    """Whether ``module`` carries a hook of ``kind`` now."""
    with _lock:
        kinds = _held.get(module)
        return kinds is not None and kind in kinds
