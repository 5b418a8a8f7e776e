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

One runner at a time holds a pipeline's compiled blocks: a second over the same
pipeline, while the first lives, is refused by name (L93: workers over one pipeline run
its modules at once, which does not give each worker's images; each worker gets its own
pipeline, as ``for_devices`` loads them). Runners over several pipelines share the
graphs (the blocks' code is one), and torch's compiler is not thread-safe (its guards,
caches and stance are the process's: pytorch/pytorch#118260), so the compiled calls of
every runner in the process take turns (``_CALLS``); the rest of a step (its eager
parts, the cancel points, the decode) still overlaps between workers, and on CUDA a
call holds the turn only while it launches its kernels. Without the turns, two
workers' sealed calls interleaved their stances: a call could compile after the seal,
and the stance stayed ``eager_on_recompile`` for the process after both (every later
``torch.compile`` silently eager).

Adapters run per row in their LoRA layers, inside the blocks: a compiled block would
trace them with every call's row layout, recompile or break the graph. So a compiled
runner takes no adapters (L93: refused by name).

Compiled artifacts persist where ``compile_cache`` points: torch's inductor cache
(``TORCHINDUCTOR_CACHE_DIR``), set before the first compile, so a restart compiles
from its cache in seconds.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ._hooks import COMPILED, ModuleHooks, has_hook

__all__ = ["MODES", "CompiledBlocks", "use_compile_cache"]

#: What ``compile`` may be: the blocks only (regional).
MODES = ("blocks",)


#: Held around every compiled call in the process: one at a time (see the docstring).
_CALLS = threading.RLock()


class _Forward:
    """A block's compiled forward and whether it is sealed."""

    __slots__ = ("_compiled", "sealed")

    def __init__(self, forward: Callable[..., Any]) -> None:
        self.sealed = False
        with warnings.catch_warnings():
            # torch's own: inductor's first import reaches torch.utils.mkldnn, which
            # uses the deprecated torch.jit.script_method (nothing the caller did).
            warnings.filterwarnings(
                "ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning
            )
            self._compiled = torch.compile(forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _CALLS:
            if not self.sealed:
                return self._compiled(*args, **kwargs)
            with torch.compiler.set_stance("eager_on_recompile"):
                return self._compiled(*args, **kwargs)


class CompiledBlocks:
    """A runner's compiled blocks; ``seal`` after the warm-up."""

    def __init__(self, blocks: list[torch.nn.Module], hooks: ModuleHooks) -> None:
        """Compile ``blocks`` in ``hooks``, the runner's.

        Raises:
            ValueError: another live runner holds these blocks compiled (the runner's
                hooks are let go: it is not made).
        """
        if any(has_hook(block, COMPILED) for block in blocks):
            hooks.close()
            raise ValueError(
                "compile: another runner holds this pipeline's compiled blocks; workers"
                " over one pipeline are refused (L93): give each its own pipeline"
            )
        self._hooks = hooks
        self._forwards: list[_Forward] = []
        for block in blocks:
            hooks.replace(block, COMPILED, self._install)

    def _install(self, forward: Callable[..., Any]) -> _Forward:
        self._forwards.append(_Forward(forward))
        return self._forwards[-1]

    @property
    def count(self) -> int:
        """How many blocks run compiled (0 once the runner's hooks are closed)."""
        return len(self._hooks.modules(COMPILED))

    @property
    def sealed(self) -> bool:
        """Whether a shape with no graph now runs eager instead of compiling."""
        return all(forward.sealed for forward in self._forwards)

    def seal(self) -> None:
        """From now on, compile nothing: a shape without a graph runs eager (L90)."""
        for forward in self._forwards:
            forward.sealed = True


def use_compile_cache(folder: str | os.PathLike[str]) -> Path:
    """Keep torch's compile caches (inductor's, triton's) under ``folder`` (made if
    missing), for every compile of this process from now on (torch reads the variables
    when it compiles): a restart that points here compiles from its cache."""
    path = Path(folder).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path
