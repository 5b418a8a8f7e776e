"""Several ranks on one request: a classifier-free-guidance split, or sequence parallel.

``ParallelRunner(factory, cfg=2)`` (or ``ulysses=2``, ``ring=2``) is one runner of the
engine, one worker (L49), whose requests run over several processes on
torch.distributed: gloo on the CPU, NCCL on CUDA devices. ``import
omni_trio.parallel`` loads torch; ``import omni_trio`` does not load this package.

Layout: the private modules, each importing only those below it:

- ``_runner``: ``ParallelRunner``, rank 0, in the engine's process: the runner the
  engine drives, the plans it sends (L40), the group's failures (L41), what its
  caches answer (L94, L95);
- ``_start``: a group's start (the arguments checked, the ranks spawned, rank 0
  built, every rank joined) and its end (every rank reaped), and what the other
  ranks said when the group breaks;
- ``_child``: ranks 1..N-1: build, join, then run the plans they are sent;
- ``_rank``: one rank's model, the same on every rank (``RankRunner``: a
  ``DiffusersRunner`` whose model calls are shared) and the other ranks' copy of
  the states (``RankStates``);
- ``_agree``: agreed cancel points (L48): all ranks leave a step at one point;
- ``_context``: diffusers' context parallelism, and what it needs on a CPU;
- ``_processes``: the rank processes (a parent-death signal, reaping);
- ``_group``: the torch.distributed group (loopback only, an explicit timeout);
- ``_plan``: the plans and ops (an adapter's or a weight update's source as one carries it),
  and ``RankReport``.

It imports the runners and the core's runner seam, never the engine, ``serve`` or
``cli``.
"""

from __future__ import annotations

from .. import _exports
from ._plan import RankReport as RankReport
from ._runner import ParallelGroupError as ParallelGroupError
from ._runner import ParallelRunner as ParallelRunner
from ._runner import ParallelState as ParallelState
from ._start import ParallelStartError as ParallelStartError

__all__ = [
    "ParallelGroupError",
    "ParallelRunner",
    "ParallelStartError",
    "ParallelState",
    "RankReport",
]

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
