"""omni_trio: a structured-concurrency serving engine for diffusion models.

Every request lives in a scope; the denoise loop runs in one owned worker thread
per device and checks a cancellation token at every step boundary; each request's
events travel over its own channel. See ``open_engine``.

General layout
--------------

Public names are re-exported here from private modules; ``import omni_trio`` loads
neither torch nor diffusers.

The data (no threads, no event loop):

- ``_errors``: the exception tree.
- ``_validate``: field checks shared by the validated dataclasses.
- ``_config``: ``EngineConfig``.
- ``_request``: ``GenerationRequest``.
- ``_codec``: a request to a record of plain data and back, every field (the job
  store, a parallel plan), and the fingerprint of its output's fields (L78).
- ``_checkpoint``: ``Checkpoint``, ``CheckpointPolicy``, ``CheckpointError`` and the
  envelope of a checkpoint's bytes (L78).
- ``_stepcache``: ``StepCache``, a request's step-cache policy, and ``CacheMetrics``,
  what it did (L80-L84); ``PromptCacheMetrics``, what a runner's prompt cache did for a
  request's texts (L94).
- ``_sampling``: ``SDESampler`` and ``DDIMSampler``, a request's stochastic sampler,
  and ``Trajectory``, the steps it returns (L100).
- ``_adapters``: the adapters a request names (checked), ``AdapterInfo``, what a
  runner reports of one, and ``AdapterError`` (L85-L88).
- ``_results``: ``ResultCache``, the result cache's configuration, its key (a
  request's output fields, its adapters' weights, the model), an output as it keeps
  it, its files, and ``ResultCacheStatistics`` (L95, L96).
- ``_weights``: weights in place and sleep (L102, L103): ``WeightVersion``, what an
  output ran on, ``SleepReport`` and ``WakeReport``, ``WeightsError`` and
  ``EngineSleepingError``, and ``WeightsRunner``, the five calls a runner implements.
- ``_outputs``: what the engine hands out: ``RequestStatus``, ``StepEvent``,
  ``GenerationOutput``, ``RequestMetrics``, ``EngineStatistics``, ``WorkerStatistics``.
- ``_mp4``: the MP4 encoder behind ``GenerationOutput.save_video`` (PyAV, imported
  only when a video is written).
- ``_reasons``: ``AbortReason``, the vocabulary of abort reasons.
- ``_runner``: the ``Runner`` protocol, the seam to a model, public as ``omni_trio.abc``
  (``runners/`` holds the diffusers implementations).
- ``_construct``: ``NoPublicConstructor``, the metaclass of the final classes that
  only the library instantiates (``Engine``, ``RequestHandle``).
- ``_exports``: gives every exported class and function its public ``__module__``.
- ``_version``: ``__version__``, written once.

The loop side (runs in the event loop's thread only):

- ``_open``: ``open_engine``, the structured entry: workers and the deadline timer
  started in its task group, the shutdown sequence run shielded on leaving.
- ``_engine``: ``Engine``: admission, abort, adapters and weights, statistics, the
  shutdown sequence; ``_ledger``, its base: the tables of requests and ``_dispatch``,
  where every state change happens.
- ``_weightops``: ``EngineWeights``, an engine's weights across its runners: updates in
  place, sleep and wake, each at the workers' step boundaries, all or nothing (L102,
  L103).
- ``_groups``: ``generate_group``, G samples of one prompt submitted at once, each a
  request of its own, and ``GroupResult``, what became of each (L101).
- ``_runner_adapters``: ``RunnerAdapters``, the engine's adapters across its runners:
  admission's check of the names, all-or-nothing loads, unloads, the listing (L85, L87).
- ``_resultstore``: ``ResultStore``, the engine's result cache: admission's lookup,
  its entries in LRU order within their bound, their files written by its own task
  (L95, L96).
- ``_record``: ``Record``, one admission as the loop sees it, and its state machine.
- ``_handle``: ``RequestHandle``, the consumer's side of one record.
- ``_owner``: ``RequestOwner``, the three calls a handle may make on its engine.
- ``_channel``: the per-request coalescing channel.
- ``_deadlines``: ``DeadlineTimer``, the one timer task that aborts requests whose
  deadline passed.
- ``_estimate``: admission's estimates, which refuse what cannot be met: a deadline
  (the work that would run before the request, L62) and one step's time (L4).

The thread side (runs in the engine's own threads only):

- ``_worker``: the step loop, one owned thread per device; ``_parking``, its suspended
  requests (L61), and ``_suspend``, its suspensions (a preemption's, a sleep's: L103);
  ``_checkpointing``, its checkpoints taken and restored (L78); ``_wholecall``, the
  loop of a runner that runs its own (its step callback is the boundary);
  ``_steptimes``, what its warm steps took by shape (L4).
- ``_pool``: what the workers share: one lock, the queue of new requests.
- ``_materialize``: decode and copy to host, off the step loop.
- ``_imagecheck``: the output contract, checked on every image and preview.
- ``_failure``: a runner's exception made into a request's failure, formatted once
  and defensively, its frames cleared.
- ``_queue``: the waiting queue, ranked by priority and deadline, and batch
  formation (pure, synchronous); ``_stepsums`` keeps its steps by deadline, with
  prefix sums, for admission's steps ahead; ``_fairshare``, the tenants' virtual
  times and what a step costs (L57).
- ``_scheduler``: the boundary policy (``plan_boundary``: pure, synchronous), and
  ``RunningBatch``, the view of its batch a worker publishes for admission.

The seam between them:

- ``_workitem``: ``WorkItem``, a request as the threads see it, and its cancel token
  (set by the loop, read by the threads at every step boundary).
- ``_messages``: what the threads post to the loop (stepped, completed, released,
  died, exited).
- ``_inbox``: the thread-to-loop hand-off that carries those messages without ever
  blocking a thread.
- ``_log``: the library's loggers and the one line of a finished request.
- ``_threads``: the engine's thread names (``ENGINE_THREAD_PREFIX``,
  ``engine_threads()``) and the process's torch thread count.
- ``_cancelpoint``: ``cancel_point()``, which a runner calls inside a step or a decode,
  and the check an engine thread arms it with for one call (L71, L72).
- ``_cacheplan``: the engine's side of step caching: loosening a threshold at a step
  boundary when a deadline is at risk, and reading a request's cache metrics at its
  release (L84).

The command line (``omni-trio`` / ``python -m omni_trio``), the ``cli`` package, sits on
top of the library, which never imports it (``__main__`` only calls ``cli.main``):

- ``cli._main``: the parser, one-line errors and exit statuses (``cli._errors``),
  ``--version``, ``--debug``; ``cli._types``: the argparse value types;
  ``cli._given``: the options given that do not apply, refused.
- ``cli._demo``: ``demo``, one image with a tiny model and a progress bar.
- ``cli._serve``: ``serve``; its options become ``serve``'s ``ServiceOptions``
  (``cli._options``), run under Hypercorn or Uvicorn (``cli._servers``) or, with
  ``--ray``, on Ray Serve (``cli._ray``); its variables, logs, access log and sockets
  (``cli._env``, ``cli._logs``, ``cli._access``, ``cli._sockets``).
- ``cli._loadtest_command``: ``load``, an open-loop load test (``cli._loadtest``, its
  client; ``cli._loadtest_math``, its schedule and figures).

The public subpackages: ``abc`` (the runner seam: ``Runner``, ``StopRun``,
``cancel_point``; torch-free), ``runners`` (diffusers pipelines, step by step; needs
torch), ``testing`` (fake runners, leak checks, invariants) and ``serve`` (the HTTP API).
"""

from __future__ import annotations

from . import _exports

# First, so that the seam's names are ``omni_trio.abc.*`` (reprs, pickles) whichever
# public package a program imports first: ``omni_trio.runners`` re-exports them too.
from . import abc as abc
from ._adapters import AdapterError as AdapterError
from ._adapters import AdapterInfo as AdapterInfo
from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import CheckpointPolicy as CheckpointPolicy
from ._config import EngineConfig as EngineConfig
from ._engine import Engine as Engine
from ._errors import DeadlineError as DeadlineError
from ._errors import DuplicateRequestError as DuplicateRequestError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import EngineDeadError as EngineDeadError
from ._errors import InvalidOutputError as InvalidOutputError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import OmniTrioError as OmniTrioError
from ._errors import QueueFullError as QueueFullError
from ._errors import RequestAbortedError as RequestAbortedError
from ._errors import RequestError as RequestError
from ._errors import RequestFailedError as RequestFailedError
from ._groups import GroupResult as GroupResult
from ._groups import GroupSample as GroupSample
from ._groups import generate_group as generate_group
from ._groups import group_seeds as group_seeds
from ._handle import RequestHandle as RequestHandle
from ._open import open_engine as open_engine
from ._outputs import EngineStatistics as EngineStatistics
from ._outputs import GenerationOutput as GenerationOutput
from ._outputs import RequestMetrics as RequestMetrics
from ._outputs import RequestStatus as RequestStatus
from ._outputs import RequestTimeline as RequestTimeline
from ._outputs import StepEvent as StepEvent
from ._outputs import WorkerStatistics as WorkerStatistics
from ._reasons import AbortReason as AbortReason
from ._request import GenerationRequest as GenerationRequest
from ._results import ResultCache as ResultCache
from ._results import ResultCacheStatistics as ResultCacheStatistics
from ._sampling import DDIMSampler as DDIMSampler
from ._sampling import SDESampler as SDESampler
from ._sampling import Trajectory as Trajectory
from ._stepcache import CacheMetrics as CacheMetrics
from ._stepcache import PromptCacheMetrics as PromptCacheMetrics
from ._stepcache import StepCache as StepCache
from ._version import __version__ as __version__
from ._weights import EngineSleepingError as EngineSleepingError
from ._weights import SleepReport as SleepReport
from ._weights import WakeReport as WakeReport
from ._weights import WeightsError as WeightsError
from ._weights import WeightVersion as WeightVersion

__all__ = [
    "AbortReason",
    "AdapterError",
    "AdapterInfo",
    "CacheMetrics",
    "Checkpoint",
    "CheckpointError",
    "CheckpointPolicy",
    "DDIMSampler",
    "DeadlineError",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineSleepingError",
    "EngineStatistics",
    "GenerationOutput",
    "GenerationRequest",
    "GroupResult",
    "GroupSample",
    "InvalidOutputError",
    "InvalidRequestError",
    "OmniTrioError",
    "PromptCacheMetrics",
    "QueueFullError",
    "RequestAbortedError",
    "RequestError",
    "RequestFailedError",
    "RequestHandle",
    "RequestMetrics",
    "RequestStatus",
    "RequestTimeline",
    "ResultCache",
    "ResultCacheStatistics",
    "SDESampler",
    "SleepReport",
    "StepCache",
    "StepEvent",
    "Trajectory",
    "WakeReport",
    "WeightVersion",
    "WeightsError",
    "WorkerStatistics",
    "generate_group",
    "group_seeds",
    "open_engine",
]

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
