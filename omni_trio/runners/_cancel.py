"""Cancel points inside a model call (L71, L72): forward pre-hooks on its blocks.

A ``DiffusersRunner`` installs, at construction, one forward pre-hook on every block
of its denoiser (the transformer blocks of a DiT, the down, mid and up blocks of a
UNet) and on its VAE's decoder (which Wan's and Qwen-Image's VAEs call once per
latent frame). The hook is ``cancel_point()``: it raises ``StopRun`` only inside a
step or decode that the engine armed, in the engine's thread (see
``omni_trio._cancelpoint``); elsewhere it reads a thread-local and returns. Nothing
a block half-did stays on the model (the blocks keep no state between calls), and
the runner clears the per-call caches a VAE keeps (``clear_cache``).

A module is hooked once however many runners share its pipeline: the hooks are
counted per module, and the last runner's ``close`` removes them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .._cancelpoint import cancel_point

__all__ = ["CancelPoints", "cancel_modules", "hooked"]

#: The attributes of a denoiser that hold its blocks, in call order (DiT, Flux, UNet).
_BLOCKS = (
    "blocks",
    "transformer_blocks",
    "single_transformer_blocks",
    "down_blocks",
    "mid_block",
    "up_blocks",
)
#: The pipeline attributes that hold a denoiser (Wan 2.2 has two experts).
_DENOISERS = ("transformer", "transformer_2", "unet")

_lock = threading.Lock()
# module -> [hook handle, how many CancelPoints hold it]; under _lock.
_hooks: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()


def cancel_modules(pipe: Any) -> list[torch.nn.Module]:
    """The modules of ``pipe`` before which a call may be left: denoiser blocks, VAE decoder."""
    modules: list[torch.nn.Module] = []
    for name in _DENOISERS:
        denoiser = getattr(pipe, name, None)
        if not isinstance(denoiser, torch.nn.Module):
            continue
        for attribute in _BLOCKS:
            blocks = getattr(denoiser, attribute, None)
            if isinstance(blocks, torch.nn.ModuleList):
                modules.extend(blocks)
            elif isinstance(blocks, torch.nn.Module):
                modules.append(blocks)
    decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
    if isinstance(decoder, torch.nn.Module):
        modules.append(decoder)
    return modules


def _hook(module: torch.nn.Module, args: object) -> None:
    cancel_point()


class CancelPoints:
    """Cancel points before ``modules``' calls; see the module doc."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        unique = {id(module): module for module in modules}
        self._modules: list[torch.nn.Module] | None = list(unique.values())
        with _lock:
            for module in self._modules:
                entry = _hooks.get(module)
                if entry is None:
                    _hooks[module] = [module.register_forward_pre_hook(_hook), 1]
                else:
                    entry[1] += 1

    @property
    def count(self) -> int:
        """How many modules are cancel points (0 once closed)."""
        return len(self._modules or ())

    def close(self) -> None:
        """Let go of the hooks; the last holder of a module's hook removes it. Idempotent."""
        modules, self._modules = self._modules, None
        with _lock:
            for module in modules or ():
                entry = _hooks.get(module)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0].remove()
                    del _hooks[module]


def hooked(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries the cancel-point hook now."""
    with _lock:
        return module in _hooks
