"""Row-invariant layers for the model calls of sampled requests (L100): a row's bits alone
or in any batch.

A stochastic request's log-probabilities must be recomputed by a trainer, in batches
of its own, to the bit. Elementwise arithmetic, normalisations and attention give a
row the same bits whatever its batch; two kernels of the CPU's do not. Measured with
torch 2.13 (MKL and oneDNN, AVX-512, one thread): a linear layer over fewer than 4
rows (the timestep and pooled-text embeddings of a batch of one to three) runs
another kernel than over 4 or more, and a convolution over one image another than
over two or more, each off by about 1e-7 relative; at and above those sizes a row's
result is the same in every batch. So in a model call with a sampled request, a
linear layer's input of fewer than ``MIN_ROWS`` rows is padded with zero rows to that
many and a convolution's batch of fewer than ``MIN_IMAGES`` images with a zero image
(8 and 2: the measured thresholds with a margin for the linear, where the extra rows
cost nothing), and the padding's outputs are dropped. The layers of the request then
compute what they compute in any batch; the padding costs a few small matrix
products per call (a second image's convolutions for an unguided UNet alone).

The wrappers go on the denoisers' linear and convolution layers (``ModuleHooks``,
kind ``NAME``) at the first model call with a sampled request, and act only inside
a call whose ``row-invariant`` part is set (``part``), or inside ``row_invariant()``:
the trainer's side, for the forward that recomputes a prediction. Other calls run the
layers as they are. A compiled runner (L90) gets none: its blocks' graphs would hold
them; its sampled requests are batch-invariant to batching's tolerance only.
Adapters' own LoRA layers, made after the wrappers went on, are not padded. On CUDA
the kernels' choices differ; this does nothing for them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._forward import CallPart, Exchange, ModelCall, current
from ._hooks import ModuleHooks

__all__ = ["MIN_IMAGES", "MIN_ROWS", "NAME", "RowInvariance", "row_invariant"]

#: The hooks' kind, and the model call part's name.
NAME = "row-invariant"

#: The fewest rows a linear layer's input has in a call with a sampled request.
MIN_ROWS = 8

#: The fewest images a convolution's input has in such a call.
MIN_IMAGES = 2

_CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
#: A convolution's batched input's dimensions (an unbatched one has one fewer).
_BATCHED_DIMS: dict[type, int] = {torch.nn.Conv1d: 3, torch.nn.Conv2d: 4, torch.nn.Conv3d: 5}

_local = threading.local()


def _active() -> bool:
    if getattr(_local, "depth", 0):
        return True
    forward = current()
    return forward is not None and forward.part(NAME) is not None


def _padded_linear(module: torch.nn.Module, proceed: Any, *args: Any, **kwargs: Any) -> Any:
    if not args or not _active():
        return proceed(*args, **kwargs)
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return proceed(*args, **kwargs)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows >= MIN_ROWS or rows == 0:
        return proceed(*args, **kwargs)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, x.shape[-1])])
    out = proceed(padded, *args[1:], **kwargs)[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _padded_convolution(module: torch.nn.Module, proceed: Any, *args: Any, **kwargs: Any) -> Any:
    if not args or not _active():
        return proceed(*args, **kwargs)
    x = args[0]
    batched = next((dims for kind, dims in _BATCHED_DIMS.items() if isinstance(module, kind)), 0)
    if not isinstance(x, torch.Tensor) or x.dim() != batched:
        return proceed(*args, **kwargs)  # an unbatched input: one image, no batch to match
    images = x.shape[0]
    if images >= MIN_IMAGES or images == 0:
        return proceed(*args, **kwargs)
    padded = torch.cat([x, x.new_zeros((MIN_IMAGES - images, *x.shape[1:]))])
    return proceed(padded, *args[1:], **kwargs)[:images]


def _layers(modules: Iterable[torch.nn.Module]) -> Iterator[tuple[torch.nn.Module, Any]]:
    """Every linear and convolution layer under ``modules``, each once, with its wrapper."""
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, torch.nn.Linear):
                yield module, _padded_linear
            elif isinstance(module, _CONVOLUTIONS):
                yield module, _padded_convolution


class _Part:
    """The part of a model call with a sampled request: its presence is the fact."""

    def narrowed(self, low: int, high: int) -> CallPart | None:
        return self

    def exchange(self) -> Exchange | None:
        return None

    def commit(self) -> None:
        return None


class RowInvariance:
    """A runner's row-invariant layers: put on at its first sampled model call, kept.

    Args:
        pipeline: the runner's pipeline.
        denoisers: the attributes of the pipeline that hold its denoisers (their layers
            get the wrappers; one may be ``None``).
        hooks: the runner's hook registry (its ``close`` takes them off).
        enabled: ``False`` for a compiled runner: no wrapper, no part.
    """

    def __init__(
        self, pipeline: Any, denoisers: Iterable[str], hooks: ModuleHooks, *, enabled: bool
    ) -> None:
        models = (getattr(pipeline, name, None) for name in denoisers)
        self._denoisers = [model for model in models if isinstance(model, torch.nn.Module)]
        self._hooks = hooks
        self._enabled = enabled
        self._installed = False

    def part(self, call: ModelCall) -> CallPart | None:
        """The call's part where one of its states samples (the model lock is held)."""
        if not self._enabled or all(getattr(s, "sampler", None) is None for s in call.states):
            return None
        if not self._installed:
            for module, wrapper in _layers(self._denoisers):
                self._hooks.wrap(module, NAME, wrapper)
            self._installed = True
        return _Part()

    @property
    def count(self) -> int:
        """How many layers carry the wrapper for this runner (0 before the first sampled
        call, and once closed)."""
        return len(self._hooks.modules(NAME))


@contextmanager
def row_invariant(*modules: torch.nn.Module) -> Iterator[None]:
    """Inside, ``modules``' linear and convolution layers compute each row as a model call
    of a sampled request does (L100): for a trainer's forward that recomputes a
    rollout's prediction bitwise, in whatever batch. In this thread only.

    The layers get the wrappers for the block's length (kept where a runner holds them
    already).
    """
    hooks = ModuleHooks()
    try:
        for module, wrapper in _layers(modules):
            hooks.wrap(module, NAME, wrapper)
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            yield
        finally:
            _local.depth -= 1
    finally:
        hooks.close()
