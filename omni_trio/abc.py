"""The runner seam, typed without torch: what a custom runner implements and may raise.

``import omni_trio.abc`` loads neither torch nor diffusers, so a runner for another
framework (or a fake) is typed against these names alone:

- ``Runner``: the protocol the engine drives, one step at a time; ``SuspendableRunner``
  the three calls more that preemption needs (L61); ``WholeCallRunner`` a runner
  that runs its own loop, with ``StepCallback`` the callback it calls after every
  step.
- ``RunnerCapabilities``: what a runner declares up front (batch size, joins,
  batch keys, previews, ...).
- ``StepCacheRunner``: the two calls more of a runner that declares ``step_cache``
  (L80-L84): a request's cache metrics, and a loosened threshold.
- ``AdapterRunner``: the four calls more of a runner that declares ``max_adapters``
  (L85-L87): load and unload adapters by name, list them, the names admission takes.
- ``CheckpointRunner``: the three calls more of a runner that declares
  ``checkpoints`` (L78), with ``pack_checkpoint``/``unpack_checkpoint`` (the envelope
  that names the model, the version and the request) and ``CheckpointError``.
- ``TrajectoryRunner``: the call more of a runner that declares ``samplers`` (L100): a
  request's trajectory.
- ``WeightsRunner``: the five calls of a runner whose weights are updated in place
  and put to sleep (L102, L103), with ``SleepBytes``, what a sleep freed.
- ``StopRun``: what the engine raises inside a runner call to stop it.
- ``cancel_point()``: what a runner that declares ``cancel_points`` calls inside a
  step or a decode (L71, L72).

``omni_trio.runners`` re-exports the same objects beside the diffusers runners.
"""

from __future__ import annotations

from . import _exports
from ._cancelpoint import cancel_point as cancel_point
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import pack_checkpoint as pack_checkpoint
from ._checkpoint import unpack_checkpoint as unpack_checkpoint
from ._runner import AdapterRunner as AdapterRunner
from ._runner import CheckpointRunner as CheckpointRunner
from ._runner import Runner as Runner
from ._runner import RunnerCapabilities as RunnerCapabilities
from ._runner import StepCacheRunner as StepCacheRunner
from ._runner import StepCallback as StepCallback
from ._runner import StopRun as StopRun
from ._runner import SuspendableRunner as SuspendableRunner
from ._runner import TrajectoryRunner as TrajectoryRunner
from ._runner import WholeCallRunner as WholeCallRunner
from ._weights import SleepBytes as SleepBytes
from ._weights import WeightsRunner as WeightsRunner

__all__ = [
    "AdapterRunner",
    "CheckpointError",
    "CheckpointRunner",
    "Runner",
    "RunnerCapabilities",
    "SleepBytes",
    "StepCacheRunner",
    "StepCallback",
    "StopRun",
    "SuspendableRunner",
    "TrajectoryRunner",
    "WeightsRunner",
    "WholeCallRunner",
    "cancel_point",
    "pack_checkpoint",
    "unpack_checkpoint",
]

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
