"""Drop the third-party notices that omni_trio's own model loading triggers.

When torchvision is not installed, importing diffusers' pipeline modules makes
transformers log, once per process, that ``CLIPImageProcessor`` and
``SiglipImageProcessor`` fall back to their PIL versions. The fallback works (the
PIL processors are the ones transformers used before it added a torchvision
backend), so the notice says nothing the user must act on, yet it used to greet
every ``omni-trio demo`` and ``serve`` start.

``quiet_notices()`` drops exactly that message, from exactly that logger, while
the library builds or loads a pipeline, and removes its filter afterwards: the
user's own imports and every other record of every logger are left alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["quiet_notices"]

_LOGGER = "transformers.utils.import_utils"
"""Where transformers logs the fallback notice (its ``_LazyModule.__getattr__``)."""

_NOTICE = "requires torchvision (not installed); falling back to"
"""The part of the notice that names it, for every image processor it is about."""


class _DropNotice(logging.Filter):
    """Refuse the records whose message carries ``_NOTICE``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _NOTICE not in record.getMessage()


class _Scope:
    """Counts the ``quiet_notices`` blocks open now, in any thread."""

    lock = threading.Lock()
    depth = 0
    filter = _DropNotice()


@contextmanager
def quiet_notices() -> Iterator[None]:
    """Drop transformers' torchvision-fallback notice inside the block.

    Blocks may nest and may run in several threads at once: the filter stays on
    the logger while any block is open.
    """
    logger = logging.getLogger(_LOGGER)
    with _Scope.lock:
        _Scope.depth += 1
        if _Scope.depth == 1:
            logger.addFilter(_Scope.filter)
    try:
        yield
    finally:
        with _Scope.lock:
            _Scope.depth -= 1
            if _Scope.depth == 0:
                logger.removeFilter(_Scope.filter)
