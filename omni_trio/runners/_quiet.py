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

Where torchao is installed (the ``quant`` extra), diffusers' modules import it, and
that import logs, once per process: torchao that its CUDA kernels (``_C_mxfp8``,
``_C_cutlass_90a``) do not load and that Triton is missing (dropped on a machine
without CUDA only: where CUDA is there, the notes matter for ``fp8``), torch that two
of torchao's enums need not be registered with pytree any more, and diffusers that it
misses torchao tensor classes that torchao 0.18 moved (only checkpoints saved by
torchao read them; omni_trio quantizes when it loads). Loading a model in int8 over
float32 (a CPU's dtype), diffusers' quantizer says only bfloat16 is supported: int8
over float32 runs, and tests/runners/test_quantize.py holds its images. None asks
anything of the user.

``quiet_notices()`` drops exactly those messages, from exactly their loggers, and
turns both libraries' progress bars off while the library builds or loads a
pipeline; afterwards it removes its filters and turns back on the bars it turned
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

#: Each notice: the logger it comes from, the part of its message that names it, and
#: whether it is dropped only where CUDA is missing (there it is about CUDA's kernels).
_NOTICES = (
    # transformers' ``_LazyModule.__getattr__``, for every image processor it is about.
    (
        "transformers.utils.import_utils",
        "requires torchvision (not installed); falling back to",
        False,
    ),
    # torchao's import: "Failed to load" each CUDA kernel library, and Triton's absence.
    ("torchao", "torchao/_C_mxfp8", True),
    ("torchao", "torchao/_C_cutlass", True),
    ("torchao.kernel.intmm", "Detected no triton", True),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported", False),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor", False),
    # Its quantizer, on every int8 load in float32 (a CPU's dtype): int8 over float32 runs.
    (
        "diffusers.quantizers.torchao.torchao_quantizer",
        "for integer quantization, but only bfloat16 is supported",
        False,
    ),
)


class _DropNotice(logging.Filter):
    """Refuse the records whose message carries ``notice`` (with ``cpu_only``, only where
    torch has no CUDA)."""

    def __init__(self, notice: str, cpu_only: bool) -> None:
        super().__init__()
        self.notice = notice
        self.cpu_only = cpu_only

    def filter(self, record: logging.LogRecord) -> bool:
        if self.notice not in record.getMessage():
            return True
        if not self.cpu_only:
            return False
        import torch

        return bool(torch.cuda.is_available())


class _Scope:
    """Counts the ``quiet_notices`` blocks open now, in any thread."""

    lock = threading.Lock()
    depth = 0
    filters: ClassVar[list[tuple[logging.Logger, _DropNotice]]] = []
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
    """Drop the notices above (transformers' torchvision fallback, torchao's import) and the
    loading bars inside the block.

    Blocks may nest and may run in several threads at once: the filters stay on
    their loggers, and the bars stay off, while any block is open. Bars the user had
    turned off stay off.
    """
    with _Scope.lock:
        _Scope.depth += 1
        if _Scope.depth == 1:
            _Scope.filters = [
                (logging.getLogger(name), _DropNotice(notice, cpu_only))
                for name, notice, cpu_only in _NOTICES
            ]
            for logger, drop in _Scope.filters:
                logger.addFilter(drop)
            _Scope.bars_off = [m for m in _bar_switches() if m.is_progress_bar_enabled()]
            for switch in _Scope.bars_off:
                switch.disable_progress_bar()
    try:
        yield
    finally:
        with _Scope.lock:
            _Scope.depth -= 1
            if _Scope.depth == 0:
                for logger, drop in _Scope.filters:
                    logger.removeFilter(drop)
                _Scope.filters = []
                for switch in _Scope.bars_off:
                    switch.enable_progress_bar()
                _Scope.bars_off = []
