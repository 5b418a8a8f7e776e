"""Regional compilation of the denoiser (L90): each block's own ``forward`` compiled, the
hooks between the blocks eager.

A ``DiffusersRunner`` built with ``compile="blocks"`` replaces, in its ``ModuleHooks``,
the own ``forward`` of every block its family names (a DiT's transformer blocks, a
UNet's down, mid and up blocks) by ``torch.compile`` of it: the innermost link of the
block's chain. What is around it stays eager and outside every graph: the cancel
point before each block (a torch pre-hook, L71), the step cache's decisions and its
slicing of a call's rows (its wrapper, L80-L83). Blocks of one class share their
graphs (torch inlines a module's parameters as inputs), so a DiT compiles one graph
per block class and shape, as diffusers' ``compile_repeated_blocks`` does.

Shapes: the first call of a shape compiles (seconds to a minute on a CPU). A server
compiles the shapes it declares at its warm-up, before it answers; then it ``seal``s:
from there a call whose shape has no graph runs eager (``torch.compiler.set_stance
("eager_on_recompile")``, around each compiled call only), so a batch that changes
size, a new resolution, never stalls the running batch for a compile. Batch sizes
after the second share torch's automatic dynamic graph; a batch of one has its own.

Adapters run per row in their LoRA layers, inside the blocks: a compiled block would
trace them with every call's row layout, recompile or break the graph. So a compiled
runner takes no adapters (L93: refused by name).

Compiled artifacts persist where ``compile_cache`` points: torch's inductor cache
(``TORCHINDUCTOR_CACHE_DIR``), set before the first compile, so a restart compiles
from its cache in seconds.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._hooks import COMPILED, ModuleHooks

__all__ = ["MODES", "CompiledBlocks", "use_compile_cache"]

#: What ``compile`` may be: the blocks only (regional).
MODES = ("blocks",)


class CompiledBlocks:
    """A runner's compiled blocks; ``seal`` after the warm-up."""

    def __init__(self, blocks: list[torch.nn.Module], hooks: ModuleHooks) -> None:
        self._sealed = False
        self._hooks = hooks
        for block in blocks:
            hooks.replace(block, COMPILED, self._compiled)

    @property
    def count(self) -> int:
        """How many blocks run compiled (0 once the runner's hooks are closed)."""
        return len(self._hooks.modules(COMPILED))

    @property
    def sealed(self) -> bool:
        """Whether a shape with no graph now runs eager instead of compiling."""
        return self._sealed

    def seal(self) -> None:
        """From now on, compile nothing: a shape without a graph runs eager (L90)."""
        self._sealed = True

    def _compiled(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        with warnings.catch_warnings():
            # torch's own: inductor's first import reaches torch.utils.mkldnn, which
            # uses the deprecated torch.jit.script_method (nothing the caller did).
            warnings.filterwarnings(
                "ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning
            )
            compiled = torch.compile(forward)

        def run(*args: Any, **kwargs: Any) -> Any:
            if self._sealed:
                with torch.compiler.set_stance("eager_on_recompile"):
                    return compiled(*args, **kwargs)
            return compiled(*args, **kwargs)

        return run


def use_compile_cache(folder: str | os.PathLike[str]) -> Path:
    """Keep torch's compile caches (inductor's, triton's) under ``folder`` (made if
    missing), for every compile of this process from now on (torch reads the variables
    when it compiles): a restart that points here compiles from its cache."""
    path = Path(folder).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path
