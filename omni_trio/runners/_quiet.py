"""Drop the third-party notices and bars that omni_trio's own model loading triggers.

When torchvision is not installed, importing diffusers' pipeline modules makes
transformers log, once per process, that ``CLIPImageProcessor`` and
``SiglipImageProcessor`` fall back to their PIL versions. The fallback works (the
PIL processors are the ones transformers used before it added a torchvision
backend), so the notice says nothing the user must act on, yet it used to greet
every ``omni-trio demo`` and ``serve`` start.

Loading a folder, diffusers draws a "Loading pipeline components" bar and
transformers a "Loading weights" bar per model, straight on stderr: among a
server's JSON log lines they are neither JSON nor logging.

``quiet_notices()`` drops exactly that message, from exactly that logger, and
turns both libraries' progress bars off while the library builds or loads a
pipeline; afterwards it removes its filter and turns back on the bars it turned
off. The user's own imports and every other record of every logger are left alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import ClassVar

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
    bars_off: ClassVar[list[ModuleType]] = []
    """The libraries' logging modules whose bars the outermost block turned off."""


def _bar_switches() -> list[ModuleType]:
    """diffusers' and transformers' logging modules: each switches its library's bars.

    transformers' switch turns huggingface_hub's bars off and on too; where
    ``HF_HUB_DISABLE_PROGRESS_BARS=0`` forces them on, it would warn instead, so the
    user's choice is kept: transformers' bars are left on.
    """
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub import constants
    from transformers.utils import logging as transformers_logging

    forced_on = constants.HF_HUB_DISABLE_PROGRESS_BARS is False
    return [diffusers_logging] if forced_on else [diffusers_logging, transformers_logging]


@contextmanager
def quiet_notices() -> Iterator[None]:
    """Drop transformers' torchvision-fallback notice and the loading bars inside the block.

    Blocks may nest and may run in several threads at once: the filter stays on
    the logger, and the bars stay off, while any block is open. Bars the user had
    turned off stay off.
    """
    logger = logging.getLogger(_LOGGER)
    with _Scope.lock:
        _Scope.depth += 1
        if _Scope.depth == 1:
            logger.addFilter(_Scope.filter)
            _Scope.bars_off = [m for m in _bar_switches() if m.is_progress_bar_enabled()]
            for switch in _Scope.bars_off:
                switch.disable_progress_bar()
    try:
        yield
    finally:
        with _Scope.lock:
            _Scope.depth -= 1
            if _Scope.depth == 0:
                logger.removeFilter(_Scope.filter)
                for switch in _Scope.bars_off:
                    switch.enable_progress_bar()
                _Scope.bars_off = []
