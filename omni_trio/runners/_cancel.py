"""Cancel points inside a model call (L71, L72): forward pre-hooks on its blocks.

A ``DiffusersRunner`` installs, at construction, one forward pre-hook on every block
of its denoiser (its family's ``denoisers`` and ``block_lists``, read through the
registry: the transformer blocks of a DiT, the down, mid and up blocks of a UNet) and
on its VAE's decoder (which Wan's and Qwen-Image's VAEs call once per
latent frame). The hook is ``cancel_point()``: it raises ``StopRun`` only inside a
step or decode that the engine armed, in the engine's thread (see
``omni_trio._cancelpoint``); elsewhere it reads a thread-local and returns. Nothing
a block half-did stays on the model (the blocks keep no state between calls), and
the runner clears the per-call caches a VAE keeps (``clear_cache``).

A module is hooked once however many runners share its pipeline: the hooks are the
runner's ``ModuleHooks`` (``_hooks``), counted per module, and the last runner's
``close`` removes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._cancelpoint import cancel_point
from ._hooks import ModuleHooks, has_hook
from ._registry import family_blocks

__all__ = ["KIND", "cancel_modules", "hold_cancel_points", "hooked", "install_cancel_points"]

#: The kind of the cancel points' hooks in ``_hooks``.
KIND = "cancel-point"


def cancel_modules(pipe: Any) -> list[torch.nn.Module]:
    """The modules of ``pipe`` before which a call may be left: denoiser blocks, VAE decoder.

    The blocks are those its family names (none for a pipeline of no family).
    """
    modules = family_blocks(pipe)
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    if isinstance(decoder, torch.nn.Module):
        modules.append(decoder)
    return modules


def _hook(module: torch.nn.Module, args: object) -> None:
    cancel_point()


def hold_cancel_points(hooks: ModuleHooks, modules: Iterable[torch.nn.Module]) -> None:
    """Hold a cancel point before each of ``modules`` in ``hooks``."""
    hooks.pre_hook(modules, KIND, _hook)


def install_cancel_points(hooks: ModuleHooks, pipe: Any) -> int:
    """Hold a cancel point before each of ``pipe``'s ``cancel_modules``; return how many."""
    hold_cancel_points(hooks, cancel_modules(pipe))
    return len(hooks.modules(KIND))


def hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries the cancel-point hook now."""
    return has_hook(module, KIND)
