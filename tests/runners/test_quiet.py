"""``quiet_notices`` turns diffusers' and transformers' progress bars off, and back on.

(The torchvision notice it drops is tested with the tiny pipelines, test_tiny.py.)
"""

from __future__ import annotations

from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from omni_trio.runners._quiet import quiet_notices


def bars() -> tuple[bool, bool]:
    """Whether diffusers' and transformers' bars are on."""
    return (
        diffusers_logging.is_progress_bar_enabled(),
        transformers_logging.is_progress_bar_enabled(),
    )


def test_the_bars_are_off_inside_and_back_on_after() -> None:
    """Inside a block (nested too) both libraries' bars are off; after the outermost, on."""
    assert bars() == (True, True)
    with quiet_notices():
        with quiet_notices():
            assert bars() == (False, False)
        assert bars() == (False, False)
    assert bars() == (True, True)


def test_bars_turned_off_before_stay_off() -> None:
    """A library whose bars were off before the block has them off after it."""
    diffusers_logging.disable_progress_bar()
    try:
        with quiet_notices():
            assert bars() == (False, False)
        assert bars() == (False, True)
    finally:
        diffusers_logging.enable_progress_bar()
