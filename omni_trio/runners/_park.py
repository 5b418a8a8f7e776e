"""Suspending a ``DiffusersRunner`` state (L61): what it holds, and moving it.

A request's state is its latents, its conditioning, the batch-shared inputs and
its scheduler, whose own tensors (the sigmas, a multistep solver's previous model
outputs, PNDM's history) are part of where the next step starts. The random
generator is kept as it is: its state is a few bytes wherever it lives, and
moving it would change the numbers it draws next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ._families import RequestState

__all__ = ["move_state", "state_tensors"]


def _holders(state: RequestState) -> Iterator[dict[str, Any]]:
    """The attribute dictionaries whose values may be tensors or lists of them."""
    yield state.cond
    yield state.shared
    yield vars(state.scheduler)


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


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_moved(item, device) for item in value]
    if isinstance(value, tuple):
        return tuple(_moved(item, device) for item in value)
    return value


def move_state(state: RequestState, device: torch.device) -> None:
    """Move every tensor of ``state`` to ``device``, in place (exact: a copy, no cast)."""
    if state.latents is not None:
        state.latents = state.latents.to(device)
    state.timesteps = state.timesteps.to(device)
    for holder in _holders(state):
        for name, value in list(holder.items()):
            holder[name] = _moved(value, device)
