"""``cache``: per-request step caching (L80-L84) against no cache and diffusers' own hook."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["diffusers_decisions"]


@contextmanager
def diffusers_decisions() -> Iterator[list[tuple[str, bool]]]:
    """Note diffusers' FirstBlockCache decisions inside: (cache context, computed) per call.

    One decision per model call for the whole batch: its head hook's
    ``_should_compute_remaining_blocks``, observed (the method is wrapped, then put back).
    """
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    noted: list[tuple[str, bool]] = []
    original = FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self: Any, residual: Any) -> bool:
        computes = bool(original(self, residual))
        noted.append((self.state_manager.context.name, computes))
        return computes

    FBCHeadBlockHook._should_compute_remaining_blocks = spy  # type: ignore[method-assign]
    try:
        yield noted
    finally:
        FBCHeadBlockHook._should_compute_remaining_blocks = original  # type: ignore[method-assign]
