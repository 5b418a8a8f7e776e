"""Suspending a ``DiffusersRunner`` state (L61): what it holds, and moving it.

A request's state is its latents, its conditioning, the batch-shared inputs, an
edit's own tensors (inpainting: the image's latents, the noise, the mask) and its
scheduler, whose own tensors (the sigmas, a multistep solver's previous model
outputs, PNDM's history) are part of where the next step starts, its step cache's
tensors (residuals, forecasts' differences: L82), and the trajectory its sampler has
recorded so far (L100). The random generator is kept as it is: its state is a few
bytes wherever it lives, and moving it would change the numbers it draws next. Objects
nested deeper in a scheduler (a DPM-SDE noise sampler) are not moved: they stay where
they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._family import RequestState

__all__ = ["park_on_host", "state_tensors", "unpark"]


def _holders(state: RequestState) -> Iterator[dict[str, Any]]:
    """The attribute dictionaries whose values may be tensors or lists of them."""
    yield state.cond
    yield state.shared
    yield state.edit  # an inpainting request's image latents, noise and mask
    yield vars(state.scheduler)
    if state.cache is not None:
        yield from state.cache.holders()
    if state.sampler is not None:
        yield state.sampler.record  # L100: a trajectory's latents, noise and log-probabilities


def state_tensors(state: RequestState) -> Iterator[torch.Tensor]:
    """Every tensor ``state`` holds (a tensor shared by two attributes may come twice)."""
    for tensor in (state.latents, state.timesteps):
        if tensor is not None:
            yield tensor
    for holder in _holders(state):
        for value in holder.values():
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (item for item in value if isinstance(item, torch.Tensor))


def _moved(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, list):
        return [_moved(item, move) for item in value]
    if isinstance(value, tuple):
        return tuple(_moved(item, move) for item in value)
    return value


def _move_all(state: RequestState, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if state.latents is not None:
        state.latents = move(state.latents)
    state.timesteps = move(state.timesteps)
    for holder in _holders(state):
        for name, value in list(holder.items()):
            holder[name] = _moved(value, move)


def park_on_host(state: RequestState) -> dict[int, torch.device]:
    """Copy every tensor of ``state`` that is off the CPU into host memory, in place.

    Returns where each moved tensor came from, keyed by the ``id`` of its host
    copy, for ``unpark``. Tensors on the CPU already (diffusers keeps a
    scheduler's sigmas there on purpose) stay as they are; a tensor held under two
    names (the state's and its scheduler's timesteps) is copied once and stays
    shared. Exact: a copy, never a cast.
    """
    copies: dict[int, torch.Tensor] = {}
    origins: dict[int, torch.device] = {}

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        copy = copies.get(id(tensor))
        if copy is None:
            copy = copies[id(tensor)] = tensor.to("cpu")
            origins[id(copy)] = tensor.device
        return copy

    _move_all(state, move)
    return origins


def unpark(state: RequestState, origins: dict[int, torch.device]) -> None:
    """Move the tensors ``park_on_host`` copied back to their own devices, in place."""
    copies: dict[int, torch.Tensor] = {}

    def move(tensor: torch.Tensor) -> torch.Tensor:
        device = origins.get(id(tensor))
        if device is None:
            return tensor
        copy = copies.get(id(tensor))
        if copy is None:
            copy = copies[id(tensor)] = tensor.to(device)
        return copy

    _move_all(state, move)
