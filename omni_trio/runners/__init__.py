"""Runners: the seam between the engine and a model.

- ``Runner`` and ``RunnerCapabilities``: the protocol a model implements;
  ``SuspendableRunner`` the three calls more that preemption needs, ``StepCacheRunner``
  the two that step caching needs (L80-L84), ``AdapterRunner`` the four that
  adapters need (L85-L87), ``CheckpointRunner`` the three that checkpoints need (L78:
  with ``pack_checkpoint``, ``unpack_checkpoint``);
  ``cancel_point()`` what a runner declaring ``cancel_points`` calls (L71, L72);
  ``TrajectoryRunner`` the call more of one that declares ``samplers`` (L100);
  ``WeightsRunner`` the five calls of one whose weights are updated in place and put
  to sleep (L102, L103), with ``SleepBytes``.
- ``transition_log_prob`` and ``row_invariant``: a trainer's side of a sampled
  request (L100): a transition's log-probability recomputed from its trajectory, and
  the denoiser's layers computing each row as the request's model calls did.
- ``DiffusersRunner``: a diffusers pipeline driven one step at a time;
  ``PromptCacheStatistics``, what its prompt cache did and holds (L94).
- ``PipelineCallRunner``: any other pipeline, through its own ``__call__``.
- ``runner_for(pipeline)``: the first where it can, else the second.
- ``ModelSpec`` and ``load(spec)``: a model as one value (a folder or a hub id, its
  dtype, its attention backend; L89) and the runner of it.
- ``tiny_pipeline``: tiny real pipelines with random weights, for tests and demos;
  ``tiny_lora``: a random LoRA file for one (made with PEFT).
- ``for_devices(make, devices)``: one runner per device, for ``open_engine``.
- The model call's room, for what runs a model call elsewhere (``omni_trio.parallel``):
  ``ModelCall``, one call of the denoiser as a value; ``rows_slice`` and
  ``token_split``, which tell the call's per-row features that this process runs a
  slice of its rows or of its tokens; ``Exchange``, what a slice must send the other
  ranks; ``context_parallel_denoisers``, a pipeline's denoisers that sequence parallel
  splits, as its family says (or why its family is refused).

Layout: the private modules, each importing only those below it:

- ``_call``: ``PipelineCallRunner`` and ``runner_for``;
- ``_diffusers``: ``DiffusersRunner``, the step loop all families share (with
  ``_park``, suspension, ``_cancel``, the cancel points' hooks, and ``_stepcache``,
  the per-request step caches inside the DiT blocks, L80-L83);
- ``_forward``: the model call's room: ``ModelCall``, the value a model call is, set
  for it in one thread-local that the per-row features read (the step cache, the
  adapters: each makes its part of the call and reads the context, never the other);
  the slices of a call that a rank runs, and the exchanges the features declare;
- ``_hooks``: one registry of the runners' hooks on torch modules (cancel points'
  pre-hooks, the step cache's and the adapters' wrappers: a chain per module, counted,
  one close);
- ``_registry``: the families (``FAMILIES``) and which drives which pipeline
  (``family_class``, ``family_for``, ``is_supported``, ``supported_pipelines``); it
  imports every family module, and the rest of the runners ask it for a pipeline's
  family and read its facts (``Family``'s class attributes: its pipelines, denoisers
  and blocks, fps, guidance parameter, sequence-parallel support, adapters);
- the families, which import the base (and ``_edit``, ``_chunks``, ``_stepcache``'s
  ``BlockSpec``), never the registry and never each other: ``_sd`` (SD, SDXL on SD,
  unconditional DDPM/DDIM), ``_flow`` (SD3, Flux, Qwen-Image), ``_video`` (Wan,
  LTX-Video);
- ``_edit``: image-to-image and inpainting for SD and SDXL;
- ``_family``: the base, ``Family`` and ``RequestState``, and the helpers that
  more than one family module uses (public names inside the private module);
- ``_stepcache``: below ``_family`` (a state holds its request's cache) and imported
  by ``_video`` too (Wan 2.2's experts each run a subset of a call's rows); it reads
  the model call's context (``_forward``) and hooks through ``_hooks``; being below
  the families, it is handed the runner's family (its ``BlockLayout``), never asks
  the registry; ``_cachestate`` below it: what it knows before a call (the blocks'
  ``BlockSpec``s and ``BlockLayout``, a request's ``RequestCache`` of per-row state);
- ``_cancel``: the cancel points' hooks, on the blocks the pipeline's family names
  (asked of the registry);
- ``_adapters``: the adapters (LoRA) of a runner, row by row inside its model calls
  (L85-L87); it reads the model call's context (which rows compute, which slice of
  rows this process runs), never the step cache, and of the families only the
  registry's facts (whether a pipeline's family takes adapters, its denoisers);
  ``_landing``, below it: where each tensor of an adapter lands (the census a load is
  checked against);
- ``_chunks``: decodes in chunks (L72);
- ``_preview``: live previews (L18), a latent-to-RGB projection both runners use;
- ``_locks``: one lock per shared component (a VAE, a tokenizer) that runners over one
  pipeline take turns with (L42);
- ``_prompts``: a runner's prompt-embedding cache (L94): each text's encoding, keyed by
  all that changes it, bounded in bytes; the families encode through it, the runner
  holds it and the adapters tell it what left the model;
- ``_compile``: the denoiser's blocks compiled, the innermost link of their hook
  chains, and sealed once the declared shapes ran (L90);
- ``_spec``: ``ModelSpec``, a model as one value, and its loading (a folder or a hub id
  through the Hugging Face cache, its dtypes, its attention backend; L89), over
  ``_load`` (a local folder, never the network);
- ``_quantize``: a spec's quantization (L91): torchao's int8 and float8 as a folder loads
  (diffusers' quantizers) or on a pipeline built in memory, a GGUF file's denoiser, and
  the bytes a quantized weight is stored in (``_checkpoint`` keys a model by them);
- ``_checkpoint``: what a checkpoint of a state holds, and how it comes back (L78);
- ``_sde``: a sampled request's steps (L100): the flow-matching SDE and DDIM with eta,
  their log-probabilities, the trajectory a request keeps (below ``_family``: a state
  holds its sampler), and ``transition_log_prob``, the trainer's side;
- ``_invariant``: the row-invariant layers of a sampled request's model calls (L100:
  a row's bits alone or in any batch), and ``row_invariant``, the trainer's side; a
  feature of the model call, as the step cache and the adapters are;
- ``_weights``: a runner's weights updated in place (a state dict or a file copied into
  the models, a LoRA as every request's base adapter) and put to sleep (moved to host
  memory, or dropped where the model's files hold them) (L102, L103).

Apart: ``_tiny`` (with ``_tinytext``, its tokenizers and text encoders' configs, and
``_quiet``), ``_tinylora``, ``_load`` and ``_devices`` import no family.
"""

from __future__ import annotations

from .. import _exports
from .. import abc as _abc
from .._cancelpoint import cancel_point as cancel_point
from .._checkpoint import CheckpointError as CheckpointError
from .._checkpoint import pack_checkpoint as pack_checkpoint
from .._checkpoint import unpack_checkpoint as unpack_checkpoint
from .._runner import AdapterRunner as AdapterRunner
from .._runner import CheckpointRunner as CheckpointRunner
from .._runner import Runner as Runner
from .._runner import RunnerCapabilities as RunnerCapabilities
from .._runner import StepCacheRunner as StepCacheRunner
from .._runner import StepCallback as StepCallback
from .._runner import StopRun as StopRun
from .._runner import SuspendableRunner as SuspendableRunner
from .._runner import TrajectoryRunner as TrajectoryRunner
from .._runner import WholeCallRunner as WholeCallRunner
from .._weights import SleepBytes as SleepBytes
from .._weights import WeightsRunner as WeightsRunner
from ._call import PipelineCallRunner as PipelineCallRunner
from ._call import runner_for as runner_for
from ._devices import for_devices as for_devices
from ._devices import visible_devices as visible_devices
from ._diffusers import DiffusersRunner as DiffusersRunner
from ._forward import Exchange as Exchange
from ._forward import ModelCall as ModelCall
from ._forward import rows_slice as rows_slice
from ._forward import token_split as token_split
from ._invariant import row_invariant as row_invariant
from ._prompts import PromptCacheStatistics as PromptCacheStatistics
from ._registry import context_parallel_denoisers as context_parallel_denoisers
from ._sde import transition_log_prob as transition_log_prob
from ._spec import ModelSpec as ModelSpec
from ._spec import load as load
from ._tiny import TINY_KINDS as TINY_KINDS
from ._tiny import TINY_VIDEO_KINDS as TINY_VIDEO_KINDS
from ._tiny import tiny_pipeline as tiny_pipeline
from ._tinylora import tiny_lora as tiny_lora

__all__ = [
    "TINY_KINDS",
    "TINY_VIDEO_KINDS",
    "DiffusersRunner",
    "Exchange",
    "ModelCall",
    "ModelSpec",
    "PipelineCallRunner",
    "PromptCacheStatistics",
    "context_parallel_denoisers",
    "for_devices",
    "load",
    "row_invariant",
    "rows_slice",
    "runner_for",
    "tiny_lora",
    "tiny_pipeline",
    "token_split",
    "transition_log_prob",
    "visible_devices",
]
# The runner seam: ``omni_trio.abc``'s names, the same objects (tests/test_exports.py).
__all__ += _abc.__all__

# Reprs, tracebacks and pickles name this package, not its private modules.
_exports.set_public_module(__name__, globals())
