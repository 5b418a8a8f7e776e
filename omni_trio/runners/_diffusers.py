"""DiffusersRunner: a diffusers pipeline, driven one denoise step at a time.

The engine owns the loop. Each request gets its own scheduler and generator,
prepared exactly as the pipeline's ``__call__`` would, so a seed gives the same
image. One ``step`` call runs one model call over the whole batch, with one
timestep per row, so requests at different steps share it; each request's
scheduler then steps its own rows.

Cancel points (L71, L72; see ``_cancel``): the runner declares ``cancel_points``, and
a step can be left before any block of the denoiser, a decode before any call of
the VAE's decoder: once per image of a batch, per tile of a large image, per latent
frame for Wan, per temporal chunk of a long LTX-Video (see ``_chunks``).

Checkpoints (L78; see ``_checkpoint``): a state's latents, scheduler, generator and
step, restored into a freshly prepared state of the same request.

Step caching (L80-L84; see ``_stepcache``): for the DiT families the runner declares
``step_cache`` and applies each request's policy row by row inside the model call.

Adapters (L85-L87; see ``_adapters``): LoRA files loaded by name while serving; each
row of a model call runs its own request's adapters and scales.

Prompt cache (L94; see ``_prompts``): each text's encoding, kept for the next request
that has it, keyed by all that changes it.

Stochastic sampling (L100; see ``_sde``, ``_invariant``): a sampler's steps and trajectory;
a sampled request's model calls give each row the same bits in any batch.

Weights in place and sleep (L102, L103; see ``_weights``): a state dict or a file copied
into the models in place, or a LoRA run unmerged by every request; the weights moved to
host memory, or dropped where the model's files hold them, and brought back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._adapters import AdapterInfo
from .._request import GenerationRequest
from .._runner import RunnerCapabilities, StopRun
from .._sampling import Trajectory
from .._stepcache import CacheMetrics, PromptCacheMetrics
from .._weights import SleepBytes, WeightSource
from ._adapters import NAME as ADAPTERS
from ._adapters import AdapterSet
from ._cancel import KIND as CANCEL_POINT
from ._cancel import install_cancel_points
from ._checkpoint import StateCopy, copy_bytes, model_key, restore_into, state_copy
from ._chunks import DecodeChunks
from ._compile import MODES as COMPILE_MODES
from ._compile import CompiledBlocks
from ._edit import keep_unmasked
from ._family import RequestState, joined
from ._forward import CallPart, ModelCall, calling
from ._hooks import ModuleHooks
from ._invariant import NAME as ROW_INVARIANT
from ._invariant import RowInvariance
from ._park import park_on_host, state_tensors, unpark
from ._preview import latent_preview
from ._prompts import PROMPT_CACHE_BYTES, PromptCache, PromptCacheStatistics
from ._registry import family_blocks, family_for
from ._sde import sampler_kinds
from ._stepcache import NAME as STEP_CACHE
from ._stepcache import BlockCache, RequestCache
from ._weights import PipelineWeights

__all__ = ["DiffusersRunner"]


def step_bounds(scheduler: Any) -> tuple[int, int | None]:
    """The fewest and the most steps (``None``: no bound) ``scheduler`` runs (L4).

    Read from its config, as measured with diffusers 0.42 on the tiny pipelines:

    - flow-matching Euler with a ``shift_terminal`` (Qwen-Image, LTX-Video) stretches
      its sigmas to the terminal value by dividing by the first one's distance from
      the last: one step is a division by zero (NaN sigmas; an ``IndexError`` later
      on LTX-Video). Two steps run;
    - PNDM without ``skip_prk_steps`` warms up with Runge-Kutta steps: below 4 its
      timesteps do not broadcast;
    - a scheduler that steps through its training timesteps (``alphas_cumprod``:
      DDIM, DDPM, PNDM, the Euler and solver families) runs at most
      ``num_train_timesteps`` of them, fewer by the ``steps_offset`` that
      ``"leading"`` spacing adds (tiny SD's DDIM at 1,000 reads index 1,000 of
      1,000); flow matching has no such bound.
    """
    config = scheduler.config
    low = 1
    if config.get("shift_terminal"):
        low = 2
    if config.get("skip_prk_steps") is False:
        low = 4
    high: int | None = None
    if hasattr(scheduler, "alphas_cumprod") and "num_train_timesteps" in config:
        high = int(config["num_train_timesteps"])
        if config.get("timestep_spacing", "leading") == "leading":
            high -= int(config.get("steps_offset", 0))
    return low, high


class DiffusersRunner:
    """Drive a diffusers pipeline step by step for the engine.

    Supports ``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``,
    ``StableDiffusion3Pipeline``, ``FluxPipeline``, ``QwenImagePipeline``,
    ``DDPMPipeline`` and ``DDIMPipeline``, and for video (L70) ``WanPipeline`` and
    ``LTXPipeline``, whose ``decode`` returns ``[N, F, C, H, W]``, and for image to video
    (L69) ``WanImageToVideoPipeline`` (Wan 2.1's) and ``LTXImageToVideoPipeline``. Requests with
    ``image`` (image-to-image) and ``mask`` (inpainting) for Stable Diffusion and
    SDXL, as their img2img and inpainting pipelines built from the same components
    (L75). The pipeline is used,
    never changed: the runner builds its own scheduler per request and leaves the
    pipeline usable after the engine closes.

    Args:
        pipeline: a pipeline of a supported family, on its device, in eval mode.
        max_batch_size: most requests one denoise step serves.
        decode_slices: decode a request's N images (videos) one at a time, so that an
            abort lands within one (L72); the VAE's own sliced decode, exactly.
        tile_above: decode an image (a video frame) of more pixels than this
            (height x width) in the VAE's overlapping tiles (its ``enable_tiling()``,
            which blends them: a small documented difference); ``None``: never.
        framewise_above: decode a video of more frames than this in the VAE's
            overlapping temporal chunks (LTX-Video's framewise decoding, which blends
            them: a documented difference); ``None`` (the default): never.
        max_adapters: the most adapters one request may name (L85); the runner
            declares 0 for a pipeline that takes none (no ``load_lora_weights``, or
            Wan 2.2's two experts).
        max_loaded_adapters: the most adapters loaded at once (L87).
        max_adapter_bytes: the most bytes of loaded adapters' weights, or ``None``.
        compile: ``"blocks"``: compile each block of the denoiser (L90, ``_compile``):
            cancel points and the step cache stay outside the graphs; adapters are
            refused (L93). ``None``: eager.
        prompt_cache_bytes: the most bytes of text encodings kept for the requests
            that repeat a text (L94, ``_prompts``); 0 keeps none.

    Raises:
        TypeError: the pipeline's family is not supported.
        ValueError: a threshold below 1, a ``compile`` that is not a mode, a negative
            ``prompt_cache_bytes``.

    Counters (any thread): ``live_states``, ``decodes``.
    """

    def __init__(
        self,
        pipeline: Any,
        *,
        max_batch_size: int = 8,
        decode_slices: bool = True,
        tile_above: int | None = 1024 * 1024,
        framewise_above: int | None = None,
        max_adapters: int = 4,
        max_loaded_adapters: int = 16,
        max_adapter_bytes: int | None = None,
        compile: str | None = None,
        prompt_cache_bytes: int = PROMPT_CACHE_BYTES,
    ) -> None:
        if compile is not None and compile not in COMPILE_MODES:
            raise ValueError(f"compile: one of {', '.join(COMPILE_MODES)}, got {compile!r}")
        chunks = DecodeChunks(
            slices=decode_slices, tile_above=tile_above, framewise_above=framewise_above
        )
        self._family = family_for(pipeline, chunks)
        self._pipeline = pipeline
        # Every hook of the runner on the pipeline's modules: cancel points, the step
        # cache's blocks, the adapters' LoRA layers (``_hooks``); one close.
        self._hooks = ModuleHooks()
        self._step_cache = BlockCache(pipeline, self._hooks, self._family)
        denoisers = self._family.denoisers  # L100: a sampled row's bits in any batch
        self._invariance = RowInvariance(pipeline, denoisers, self._hooks, enabled=compile is None)
        # Held around every model call; loads and unloads take it too (see ``_adapters``).
        self._model_lock = threading.RLock()
        self._prompts = PromptCache(pipeline, prompt_cache_bytes)
        self._adapters = AdapterSet(
            pipeline,
            self._model_lock,
            max_loaded_adapters,
            max_adapter_bytes,
            self._hooks,
            refusal=None
            if compile is None
            else "a compiled runner takes no adapters: their rows run inside its blocks"
            " (L93); run it without compile to load adapters",
            on_removed=self._prompts.drop_adapter,
        )
        self._weights = PipelineWeights(
            pipeline,
            self._model_lock,
            self._adapters,
            self._family.denoisers[0],
            self._weights_changed,
        )
        # L102: what names the weights since the last update ("": as loaded), and the
        # name of an update applied but not yet committed.
        self._weights_key = ""
        self._pending_key = ""
        min_steps, max_steps = step_bounds(pipeline.scheduler)
        self._capabilities = RunnerCapabilities(
            max_batch_size=max_batch_size,
            can_join=True,
            # A video's frames are batch-wide: one model call covers the whole clip.
            batch_key_fields=(
                ("height", "width")
                if self._family.frames is None
                else ("height", "width", "num_frames")
            ),
            previews=True,
            size_multiple=self._family.size_multiple,
            extra_keys=self._family.extra_keys,
            negative_prompt=self._family.negative_prompt,
            fixed_size=self._family.fixed_size,
            suspendable=True,
            image_input=self._family.edits or self._family.image_to_video,
            mask_input=self._family.edits,
            image_to_video=self._family.image_to_video,
            frames=self._family.frames,
            cancel_points=True,
            step_cache=self._step_cache.kinds,
            min_steps=min_steps,
            max_steps=max_steps,
            max_adapters=max_adapters if self._adapters.supported else 0,
            checkpoints=True,
            samplers=sampler_kinds(pipeline.scheduler, self._family.samplers),
        )
        install_cancel_points(self._hooks, pipeline)
        # L90: the blocks' own forwards compiled, innermost of their chains.
        self._compiled = (
            None if compile is None else CompiledBlocks(family_blocks(pipeline), self._hooks)
        )
        device = torch.device(pipeline.device)
        # On CUDA, decodes run on their own stream and copy into pinned host
        # memory, overlapping the next steps on the default stream.
        self._decode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._lock = threading.Lock()
        self._model_key: str | None = None  # made at the first checkpoint (L78)
        self.live_states = 0
        self.decodes = 0

    @property
    def capabilities(self) -> RunnerCapabilities:
        """Batching with joins at any step, previews, the family's size rules, suspension."""
        return self._capabilities

    @property
    def family(self) -> str:
        """The model family.

        One of ``"sd"``, ``"sdxl"``, ``"sd3"``, ``"flux"``, ``"qwen-image"``, ``"unet"``,
        and for video ``"wan"``, ``"ltx"``, ``"wan-i2v"`` and ``"ltx-i2v"`` (image to video, L69).
        """
        return self._family.name

    def _count(self, name: str, amount: int) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def prepare(self, request: GenerationRequest, request_id: str) -> RequestState:
        """Encode the prompt, make the initial latents and the request's scheduler.

        Holds the request's adapters until ``discard``, reloading an evicted one.

        Raises:
            AdapterError: an adapter was unloaded after admission or cannot be
                reloaded (L87): the request fails, it never runs without it.
        """
        with self._model_lock:
            held = self._weights.base_pairs + self._adapters.acquire(request.adapter_pairs)
            text = self._adapters.text_adapters(held)
            try:
                with (
                    torch.no_grad(),
                    self._adapters.every_row(held),
                    self._prompts.scope(text, self._family.device) as prompts,
                ):
                    state = self._family.prepare(request, request_id)
            except BaseException:
                self._adapters.release(request.adapter_pairs)
                raise
        state.adapters = held
        state.prompts = prompts.metrics()
        assert state.latents is not None
        rows = state.latents.shape[0] * (2 if state.cfg else 1)
        state.cache = RequestCache.create(request, rows)
        self._count("live_states", 1)
        return state

    def step(self, states: Sequence[RequestState]) -> None:
        """Run one step for every state: one batched model call per round of calls.

        A cancel point before every block of the denoiser (L71).

        Raises:
            StopRun: from a cancel point; the states are left half-stepped, for the
                engine to discard.
        """
        with self._model_lock, torch.no_grad():
            calls = [state.groups[state.steps_done] for state in states]
            for round_ in range(max(calls)):
                self._model_round([s for s, n in zip(states, calls, strict=True) if n > round_])
            for state in states:
                state.steps_done += 1
                if self._decode_stream is not None and state.steps_done == len(state.groups):
                    state.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    state.ready.record()

    def _model_round(self, states: Sequence[RequestState]) -> None:
        family = self._family
        inputs: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        for state in states:
            assert state.latents is not None
            t = state.timesteps[state.position]
            rows = torch.cat([state.latents] * 2) if state.cfg else state.latents
            rows = family.scale_input(state, rows, t)
            inputs.append(rows)
            steps.append(t.expand(rows.shape[0]).to(rows.device))
        joined_rows = joined(inputs)
        call = ModelCall(
            states=tuple(states),
            rows=tuple(rows.shape[0] for rows in inputs),
            device=joined_rows.device,
        )
        found: tuple[tuple[str, CallPart | None], ...] = (
            (STEP_CACHE, self._step_cache.part(call)),
            (ADAPTERS, self._adapters.part(call)),
            (ROW_INVARIANT, self._invariance.part(call)),
        )
        parts = {name: part for name, part in found if part is not None}
        with calling(call, parts):
            output = self._denoise(
                joined_rows, joined(steps), family.join_cond(states), states[0].shared
            )
        start = 0
        for state, rows in zip(states, inputs, strict=True):
            prediction = output[start : start + rows.shape[0]]
            start += rows.shape[0]
            if state.cfg:
                prediction = family.guide(state, prediction)
            t = state.timesteps[state.position]
            state.latents = family.scheduler_step(state, prediction, t)
            if state.edit:
                keep_unmasked(state)
            state.position += 1

    def _denoise(
        self, rows: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor], shared: Any
    ) -> torch.Tensor:
        """One model call over a round's rows: the family's.

        The seam of a subclass that runs the call elsewhere: ``omni_trio.parallel``
        splits it over its ranks.
        """
        return self._family.denoise(rows, t, cond, shared)

    def trajectory(self, state: RequestState) -> Trajectory:
        """The trajectory of a sampled request that returns one (L100; see ``_sde``)."""
        if state.sampler is None or not state.sampler.returns:
            raise ValueError("trajectory: the request returns no trajectory")
        return state.sampler.trajectory()

    def preview(self, state: RequestState) -> torch.Tensor:
        """Project the current latents to RGB with a fixed linear map, on the CPU."""
        with torch.no_grad():
            if self._family.name == "unet":
                return self._family.decode(state).float().cpu()
            return latent_preview(self._family.preview_latents(state))

    def decode(self, state: RequestState) -> torch.Tensor:
        """Decode the final latents through the pipeline's VAE.

        On CUDA the decode runs on a side stream after the request's last step,
        and the images land in pinned host memory. A cancel point before every
        call of the VAE's decoder: every chunk (L72).

        Raises:
            StopRun: from a cancel point; the VAE's per-call cache is cleared first.
        """
        self._count("decodes", 1)
        try:
            return self._decode(state)
        except StopRun:
            # Wan's and Qwen-Image's VAEs keep the frames' features until the decode ends.
            clear = getattr(getattr(self._pipeline, "vae", None), "clear_cache", None)
            if callable(clear):
                clear()
            raise

    def _decode(self, state: RequestState) -> torch.Tensor:
        with torch.no_grad():
            stream = self._decode_stream
            if stream is None:
                return self._family.decode(state)
            with torch.cuda.stream(stream):
                if state.ready is not None:
                    stream.wait_event(state.ready)
                images = self._family.decode(state).float()
                host = torch.empty(images.shape, dtype=torch.float32, pin_memory=True)
                host.copy_(images, non_blocking=True)
                copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied.record(stream)
            copied.synchronize()
            return host

    def discard(self, state: RequestState) -> None:
        """Drop the state's tensors."""
        state.latents = None
        state.cond = {}
        state.shared = {}
        state.edit = {}
        state.ready = None
        state.cache = None
        if state.adapters:
            state.adapters = ()
            self._adapters.release(state.request.adapter_pairs)
        self._count("live_states", -1)

    def state_bytes(self, state: RequestState) -> int:
        """The bytes of the state's tensors: latents, conditioning, an edit's, scheduler (L61)."""
        seen: set[int] = set()
        total = 0
        for tensor in state_tensors(state):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.nbytes
        return total

    def suspend(self, state: RequestState, *, to_host: bool) -> None:
        """Park the state; with ``to_host``, move its tensors to host memory (L61)."""
        if to_host:
            state.parked_from = park_on_host(state)

    def resume(self, state: RequestState) -> None:
        """Move a state parked in host memory back to its devices; the next step continues it."""
        if state.parked_from is not None:
            unpark(state, state.parked_from)
            state.parked_from = None

    def checkpoint(self, state: RequestState) -> tuple[StateCopy, str]:
        """A copy of the state's latents, scheduler, generator and step (L78), and the
        model's key now: the bytes name the weights the copy was made on (L102).

        Raises:
            ValueError: a request with a step cache, or a scheduler holding an object
                a checkpoint cannot keep.
        """
        with torch.no_grad():
            return state_copy(state), self._key()

    def checkpoint_bytes(self, copy: object) -> bytes:
        """The copy, moved to the host, as the checkpoint's bytes (materializer thread)."""
        assert isinstance(copy, tuple)
        state, key = copy
        assert isinstance(state, StateCopy) and isinstance(key, str)
        return copy_bytes(state, key)

    def restore(
        self, request: GenerationRequest, request_id: str, data: bytes
    ) -> tuple[RequestState, int]:
        """Prepare the request, then give it the checkpoint's latents, scheduler and step.

        Raises:
            CheckpointError: not a checkpoint of this model (its family, class and
                weights), this omni_trio version and this request; or cut or altered.
        """
        key = self._key()
        state = self.prepare(request, request_id)
        try:
            return state, restore_into(state, data, key)
        except BaseException:
            self.discard(state)
            raise

    def _key(self) -> str:
        """The checkpoints' model key: the family, the class and the weights (sampled),
        and after an update its key (L102). Made awake, and kept through a sleep."""
        with self._lock:
            if self._model_key is None:
                key = model_key(self._family.name, self._pipeline)
                self._model_key = f"{key}:{self._weights_key}" if self._weights_key else key
            return self._model_key

    def result_fingerprint(self) -> str:
        """Name the model its outputs come from, for an engine's result cache (L95): its
        checkpoints' model key (the family, the class, each component's config and weights,
        sampled, a quantization's layout), each model's dtype and attention backends, the
        kind of device, whether it is compiled, where a decode is tiled, and the torch and
        diffusers versions. A pass over the parameters' ends, the first time."""
        import diffusers

        models = [
            (name, module)
            for name, module in sorted(self._pipeline.components.items())
            if isinstance(module, torch.nn.Module)
        ]
        dtypes = [f"{name}={module.dtype}" for name, module in models if hasattr(module, "dtype")]
        backends = sorted(
            {
                f"{name}:{backend}"
                for name, module in models
                for part in module.modules()
                if (
                    backend := getattr(getattr(part, "processor", None), "_attention_backend", None)
                )
            }
        )
        chunks = self._family.chunks
        return " ".join(
            [
                self._key(),
                *dtypes,
                *backends,
                torch.device(self._pipeline.device).type,
                f"compile={self._compiled is not None}",
                f"tile_above={chunks.tile_above}",
                f"framewise_above={chunks.framewise_above}",
                f"torch={torch.__version__}",
                f"diffusers={diffusers.__version__}",
            ]
        )

    def cache_metrics(self, state: RequestState) -> CacheMetrics | None:
        """What the request's step cache did so far (L84); ``None`` without a policy."""
        return None if state.cache is None else state.cache.metrics()

    def set_cache_threshold(self, state: RequestState, threshold: float) -> None:
        """Use ``threshold`` for the request's next model calls (first-block; L84)."""
        cache = state.cache
        if cache is None or cache.policy.kind != "first-block":
            raise ValueError("set_cache_threshold: the request has no first-block cache")
        if threshold != cache.threshold:
            cache.threshold = threshold
            cache.loosened = True

    def load_adapter(self, name: str, source: str | os.PathLike[str] | Mapping[str, Any]) -> None:
        """Load the LoRA at ``source`` as ``name``, while serving (L85).

        ``source``: a ``.safetensors`` file in the diffusers/PEFT format (or a format
        diffusers' ``load_lora_weights`` converts), or such a state dict (kept by
        reference, to reload it after an eviction). The text encoders' LoRA layers
        load too where it has them. Any thread: the load waits for the step under
        way (see ``_adapters``). Evicts the least recently used adapters no request
        holds when the bounds need it (L87).

        Raises:
            AdapterError: ``name`` is loaded already (``exists``); ``source`` is not
                a plain LoRA for this model (``invalid``: nothing of it stays); no
                room (``full``).
            InvalidRequestError: ``name`` is not an adapter name.
        """
        self._adapters.load(name, source)

    def unload_adapter(self, name: str) -> None:
        """Unload ``name`` (L85); refused while a live request holds it.

        Raises:
            AdapterError: ``unknown`` (not loaded) or ``in-use``.
        """
        self._adapters.unload(name)

    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The adapters this runner knows, by name: loaded or evicted, bytes, holders."""
        return self._adapters.infos()

    def adapter_names(self) -> frozenset[str]:
        """The names requests may use now (admission reads them, L85)."""
        return self._adapters.names()

    def prompt_cache_statistics(self) -> PromptCacheStatistics:
        """What the prompt cache did and holds now (L94); any thread."""
        return self._prompts.statistics()

    def prompt_cache_metrics(self, state: RequestState) -> PromptCacheMetrics | None:
        """What the prompt cache did for the request's texts in its ``prepare`` (L94)."""
        return state.prompts

    def clear_prompt_cache(self) -> None:
        """Drop every kept text encoding (L94): call it after changing the text encoders'
        weights other than through ``load_adapter`` and ``unload_adapter``."""
        self._prompts.clear()

    # -- weights in place and sleep (L102, L103) ----------------------------------

    def update_weights(self, source: WeightSource, *, key: str) -> None:
        """Apply ``source`` to the models in place, keeping what it replaces (L102).

        A ``.safetensors`` file or a state dict: the denoiser's tensors, or each name
        prefixed with its component (``vae.decoder...``), or components to state dicts;
        each copied into the tensor of its name (a LoRA layer's base too). A LoRA is run
        unmerged by every request's rows at scale 1 (PEFT's computation, as a trainer's
        forward), replacing the LoRA of an earlier update. Clears the prompt cache;
        ``key`` joins the checkpoints' model key at ``commit_weights``. Called while no
        request runs (``WeightsRunner``).

        Raises:
            WeightsError: a tensor that names nothing of the model, of another shape, a
                quantized one, a LoRA it does not take; the runner is asleep. Nothing
                changed.
        """
        self._weights.update(source)
        self._pending_key = key

    def commit_weights(self) -> None:
        """Forget what the last update replaced; its key names the model from now on."""
        self._weights.commit()
        with self._lock:
            self._weights_key, self._pending_key = self._pending_key, ""
            self._model_key = None

    def revert_weights(self) -> None:
        """Put back what the last update replaced."""
        self._weights.revert()
        self._pending_key = ""

    def sleep_weights(self, level: int) -> SleepBytes:
        """Move the models' weights off their devices (L103): level 1 to host memory
        (pinned on CUDA), level 2 dropped where the model's folder holds them (see
        ``_weights``). The model key is made first (a checkpoint's bytes name it)."""
        self._key()
        return self._weights.sleep(level)

    def wake_weights(self) -> None:
        """Bring the weights back to their devices, bit for bit (L103).

        Raises:
            WeightsError: a file a level-2 sleep dropped weights of changed since.
        """
        self._weights.wake()

    def _weights_changed(self) -> None:
        """L102: what was encoded or keyed with the old weights is theirs alone."""
        self._prompts.clear()
        with self._lock:
            self._model_key = None

    def close(self) -> None:
        """Remove the cancel points' hooks, the step cache's wrappers and the adapters,
        and free the prompt cache.

        The pipeline belongs to the caller and stays usable (asleep, its weights come
        back first); the adapters this runner loaded leave it (PEFT's LoRA layers, with
        no adapter in them, stay), and a LoRA update's with them.
        """
        self._weights.close()
        self._adapters.close()
        self._hooks.close()
        self._prompts.close()

    @property
    def compiled_blocks(self) -> int:
        """How many denoiser blocks run compiled (L90); 0 without ``compile`` or closed."""
        return 0 if self._compiled is None else self._compiled.count

    def seal_compile(self) -> None:
        """From now on a shape without a compiled graph runs eager, never compiles
        (L90): call it once the declared shapes ran (a server's warm-up). Nothing
        without ``compile``."""
        if self._compiled is not None:
            self._compiled.seal()

    @property
    def step_cache_blocks(self) -> int:
        """How many denoiser blocks carry the step cache's wrapper (L80); 0 once closed."""
        return self._step_cache.count

    @property
    def cancel_point_count(self) -> int:
        """How many modules of the pipeline are cancel points (L71, L72); 0 once closed."""
        return len(self._hooks.modules(CANCEL_POINT))
