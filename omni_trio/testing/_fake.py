"""Deterministic fake runners: no model, no GPU, exact counters."""

from __future__ import annotations

import io
import math
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import anyio
import torch

from .._cancelpoint import cancel_point
from .._checkpoint import CheckpointError, pack_checkpoint, unpack_checkpoint
from .._request import GenerationRequest
from .._runner import RunnerCapabilities
from .._stepcache import CacheMetrics, StepCache

__all__ = ["FakeRunner", "FakeState", "GatedRunner"]

#: Latent pixels per image pixel side, as in the Stable Diffusion VAE.
LATENT_SCALE = 8
LATENT_CHANNELS = 4
#: The model a ``FakeRunner``'s checkpoints name (L78).
_MODEL_KEY = "FakeRunner"


@dataclass(eq=False, slots=True)
class FakeState:
    """One request's state in a ``FakeRunner``."""

    request_id: str
    latents: torch.Tensor
    prompt_code: float
    steps_done: int
    total: int
    discarded: bool = False
    #: Suspended (L61): stepping, previewing or decoding it is a runner error.
    parked: bool = False
    #: Suspended with ``to_host``: its latents would be in host memory.
    on_host: bool = False
    #: The request's ``num_frames`` (a video runner's, L70), else ``None``.
    frames: int | None = None
    #: The request's step-cache policy (with ``step_cache``, L80), else ``None``.
    cache: StepCache | None = None
    #: Every threshold ``set_cache_threshold`` set for it, in order (L84).
    cache_thresholds: list[float] | None = None
    #: The request (a checkpoint names it, L78).
    request: GenerationRequest | None = None


class FakeRunner:
    """A deterministic runner for tests and demos.

    Each request's images depend only on the request (seed, prompt, size, steps,
    number of images), never on its batch-mates: every state is updated on its
    own, and a batch is only a list of states.

    Args:
        step_seconds: sleep this long once per batch step (simulated compute).
        fail_at_step: raise ``RuntimeError`` when a member is about to run this
            step (1-based): the whole batch fails, as a real model call would.
        decode_seconds: sleep this long in every decode.
        max_batch_size: the runner's own batch limit.
        suspendable: whether it declares ``suspendable`` (L61): its states can be
            parked between steps and resumed exactly.
        frames: ``None`` for images; ``(a, b)`` makes it a video runner
            (``RunnerCapabilities.frames``, L70) whose decode returns
            ``[N, F, C, H, W]``: the image, dimmed frame by frame.
        blocks: with more than 0, it declares ``cancel_points`` (L71, L72): a step
            runs this many virtual blocks and a decode this many chunks, with a
            ``cancel_point()`` before each; ``step_seconds`` is spread over
            the blocks. A step's states change only after its last block, so a
            step left mid-way changes nothing.
        step_cache: it declares ``step_cache`` (L80-L84) for both kinds and keeps
            each request's policy; it skips nothing (its images are those of no
            policy), reports every row-call computed in ``cache_metrics``, and
            records the thresholds the engine sets (``FakeState.cache_thresholds``).
        checkpoints: it declares ``checkpoints`` (L78): a checkpoint holds the
            latents and the step; ``restore`` refuses one of another request,
            version or runner, and one cut or altered (``CheckpointError``).

    Counters (read them from any thread): ``live_states`` (states held now),
    ``prepares``, ``steps_run`` (member-steps), ``batch_steps`` (``step`` calls
    that finished), ``decodes`` (decodes that finished), ``previews``,
    ``suspends``, ``resumes``, ``parked_states`` (suspended now), ``blocks_run``
    and ``chunks_decoded`` (with ``blocks``), ``checkpoints_taken`` and ``restores``
    (with ``checkpoints``), ``closed``, and ``threads`` (names
    of the threads that called it).
    """

    def __init__(
        self,
        *,
        step_seconds: float = 0.0,
        fail_at_step: int | None = None,
        decode_seconds: float = 0.0,
        max_batch_size: int = 64,
        suspendable: bool = True,
        frames: tuple[int, int] | None = None,
        blocks: int = 0,
        step_cache: bool = False,
        checkpoints: bool = False,
    ) -> None:
        if blocks < 0:
            raise ValueError(f"blocks: must be >= 0, got {blocks}")
        self.step_seconds = step_seconds
        self.fail_at_step = fail_at_step
        self.decode_seconds = decode_seconds
        self.blocks = blocks
        self._capabilities = RunnerCapabilities(
            max_batch_size=max_batch_size,
            can_join=True,
            batch_key_fields=("height", "width", "num_images"),
            previews=True,
            size_multiple=LATENT_SCALE,
            suspendable=suspendable,
            frames=frames,
            cancel_points=blocks > 0,
            step_cache=frozenset({"first-block", "taylorseer"}) if step_cache else frozenset(),
            checkpoints=checkpoints,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.live_states = 0
        self.prepares = 0
        self.steps_run = 0
        self.batch_steps = 0
        self.decodes = 0
        self.previews = 0
        self.suspends = 0
        self.resumes = 0
        self.parked_states = 0
        self.blocks_run = 0
        self.chunks_decoded = 0
        self.checkpoints_taken = 0
        self.restores = 0
        self.closed = False
        self.threads: set[str] = set()

    @property
    def capabilities(self) -> RunnerCapabilities:
        """Batching with joins, previews, sizes in multiples of 8, suspension."""
        return self._capabilities

    def result_fingerprint(self) -> str:
        """Name the model its outputs come from, for a result cache's key (L95): the same
        for every fake runner, whose images depend on the request alone."""
        return f"omni_trio.testing.{_MODEL_KEY} 1"

    def _count(self, **increments: int) -> None:
        with self._changed:
            self.threads.add(threading.current_thread().name)
            for name, amount in increments.items():
                setattr(self, name, getattr(self, name) + amount)
            self._changed.notify_all()

    def prepare(self, request: GenerationRequest, request_id: str) -> FakeState:
        """Make the initial latents from the seed."""
        generator = torch.Generator().manual_seed(request.seed or 0)
        latents = torch.randn(
            request.num_images,
            LATENT_CHANNELS,
            request.height // LATENT_SCALE,
            request.width // LATENT_SCALE,
            generator=generator,
        )
        code = (zlib.crc32(request.prompt.encode()) % 1000) / 1000.0
        self._count(prepares=1, live_states=1)
        cache = request.cache if request.cache is not None and request.cache.skips else None
        return FakeState(
            request_id,
            latents,
            code,
            0,
            request.num_steps,
            frames=request.num_frames,
            cache=cache,
            cache_thresholds=[] if cache is not None else None,
            request=request,
        )

    def step(self, states: Sequence[FakeState]) -> None:
        """Advance each state by one step; sleep ``step_seconds`` once.

        With ``blocks``, a cancel point before each virtual block (L71); its
        ``StopRun`` leaves the step with every state as it was.
        """
        if self.fail_at_step is not None and any(
            state.steps_done + 1 == self.fail_at_step for state in states
        ):
            self._count()
            raise RuntimeError(f"FakeRunner: failing at step {self.fail_at_step}")
        if self.blocks:
            for _ in range(self.blocks):
                cancel_point()
                self._block()
                self._count(blocks_run=1)
        elif self.step_seconds > 0:
            time.sleep(self.step_seconds)
        for state in states:
            self._check_usable(state, "step")
            phase = state.prompt_code + math.pi * state.steps_done / state.total
            state.latents.mul_(0.9).add_(0.1 * math.cos(phase))
            state.steps_done += 1
        self._count(steps_run=len(states), batch_steps=1)

    def _block(self) -> None:
        """One virtual block of a step: its share of ``step_seconds``."""
        if self.step_seconds > 0:
            time.sleep(self.step_seconds / self.blocks)

    def _chunk(self) -> None:
        """One chunk of a decode (``GatedRunner`` waits here)."""

    @staticmethod
    def _check_usable(state: FakeState, call: str) -> None:
        if state.discarded:
            raise RuntimeError(f"FakeRunner: {call} of discarded state {state.request_id}")
        if state.parked:
            raise RuntimeError(f"FakeRunner: {call} of suspended state {state.request_id}")

    def preview(self, state: FakeState) -> torch.Tensor:
        """A sigmoid of three latent channels, at latent resolution."""
        self._check_usable(state, "preview")
        self._count(previews=1)
        return torch.sigmoid(state.latents[:, :3]).clone()

    def decode(self, state: FakeState) -> torch.Tensor:
        """Upsample three latent channels to image size.

        With ``blocks``, a cancel point before each of as many chunks (L72).
        """
        self._check_usable(state, "decode")
        if self.decode_seconds > 0:
            time.sleep(self.decode_seconds)
        for _ in range(self.blocks):
            cancel_point()
            self._chunk()
            self._count(chunks_decoded=1)
        images = torch.sigmoid(state.latents[:, :3])
        images = images.repeat_interleave(LATENT_SCALE, dim=2).repeat_interleave(
            LATENT_SCALE, dim=3
        )
        if state.frames is not None:
            # A video: frame f is the image dimmed by f / (2F), so the frames differ.
            dim = 1 - torch.arange(state.frames, dtype=images.dtype) / (2 * state.frames)
            images = images[:, None] * dim[None, :, None, None, None]
        self._count(decodes=1)
        return images

    def discard(self, state: FakeState) -> None:
        """Forget the state."""
        if state.discarded:
            raise RuntimeError(f"FakeRunner: state of {state.request_id} discarded twice")
        state.discarded = True
        if state.parked:
            state.parked = False
            self._count(live_states=-1, parked_states=-1)
        else:
            self._count(live_states=-1)

    def cache_metrics(self, state: FakeState) -> CacheMetrics | None:
        """Every row-call computed (nothing skips); the last threshold set, if any."""
        policy = state.cache
        if policy is None:
            return None
        rows = state.latents.shape[0]
        thresholds = state.cache_thresholds or []
        return CacheMetrics(
            kind=policy.kind,
            calls_computed=state.steps_done * rows,
            calls_skipped=0,
            blocks_computed=state.steps_done * rows * max(self.blocks, 1),
            blocks_skipped=0,
            threshold=thresholds[-1] if thresholds else policy.threshold,
            loosened=bool(thresholds),
            pattern=("C" * state.steps_done,) * rows,
        )

    def set_cache_threshold(self, state: FakeState, threshold: float) -> None:
        """Record ``threshold`` (L84)."""
        self._check_usable(state, "set_cache_threshold")
        if state.cache_thresholds is None:
            raise RuntimeError(f"FakeRunner: {state.request_id} has no step cache")
        state.cache_thresholds.append(threshold)

    def state_bytes(self, state: FakeState) -> int:
        """The bytes of the state's latents."""
        return state.latents.nbytes

    def suspend(self, state: FakeState, *, to_host: bool) -> None:
        """Mark the state parked; nothing moves (the latents are on the CPU already)."""
        self._check_usable(state, "suspend")
        state.parked, state.on_host = True, to_host
        self._count(suspends=1, parked_states=1)

    def resume(self, state: FakeState) -> None:
        """Mark the state usable again."""
        if not state.parked or state.discarded:
            raise RuntimeError(f"FakeRunner: resume of a state not suspended: {state.request_id}")
        state.parked = state.on_host = False
        self._count(resumes=1, parked_states=-1)

    def checkpoint(self, state: FakeState) -> tuple[GenerationRequest, torch.Tensor, int]:
        """A copy of the latents and the step (L78)."""
        self._check_usable(state, "checkpoint")
        assert state.request is not None
        self._count(checkpoints_taken=1)
        return state.request, state.latents.clone(), state.steps_done

    def checkpoint_bytes(self, copy: object) -> bytes:
        """The copy as an omni_trio checkpoint of runner ``FakeRunner``."""
        request, latents, steps = cast("tuple[GenerationRequest, torch.Tensor, int]", copy)
        data = io.BytesIO()
        torch.save({"latents": latents}, data)
        return pack_checkpoint(data.getvalue(), model=_MODEL_KEY, request=request, step=steps)

    def restore(
        self, request: GenerationRequest, request_id: str, data: bytes
    ) -> tuple[FakeState, int]:
        """The state after the checkpoint's step (``CheckpointError`` if it is not ours)."""
        payload, steps = unpack_checkpoint(data, model=_MODEL_KEY, request=request)
        try:
            latents = torch.load(io.BytesIO(payload), weights_only=True)["latents"]
        except Exception as exc:
            raise CheckpointError(f"its payload does not load ({type(exc).__name__})") from None
        state = self.prepare(request, request_id)
        if latents.shape != state.latents.shape or not 0 <= steps < state.total:
            self.discard(state)
            raise CheckpointError("its latents or its step do not fit the request")
        state.latents, state.steps_done = latents, steps
        self._count(restores=1)
        return state, steps

    def close(self) -> None:
        """Mark the runner closed."""
        with self._changed:
            self.threads.add(threading.current_thread().name)
            self.closed = True
            self._changed.notify_all()

    def wait_until_sync(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block this thread until ``predicate()`` holds after a runner call.

        Meant for tests that must prove the worker progresses while the event
        loop is blocked. Returns whether it held before ``timeout`` seconds.
        """
        with self._changed:
            return self._changed.wait_for(predicate, timeout)


class GatedRunner(FakeRunner):
    """A ``FakeRunner`` whose every step waits until the test releases it.

    ``release(n)`` lets ``n`` more steps run; ``open_gate()`` lets all run.
    ``arrived`` counts the steps that reached the gate. With ``gate_decodes``,
    decodes wait too, for ``release_decode(n)``; ``decodes_arrived`` counts them.
    With ``blocks`` (cancel points, L71, L72) and ``gate_blocks``, every block of
    a step waits instead of the step (``arrived`` counts blocks, each after the
    checkpoint before it), and with ``gate_decodes`` every chunk of a decode.
    A call that waits more than ``gate_timeout`` seconds raises ``RuntimeError``,
    so a test that forgets to release fails instead of hanging.
    """

    def __init__(
        self,
        *,
        gate_timeout: float = 20.0,
        gate_decodes: bool = False,
        step_seconds: float = 0.0,
        fail_at_step: int | None = None,
        max_batch_size: int = 64,
        suspendable: bool = True,
        frames: tuple[int, int] | None = None,
        blocks: int = 0,
        gate_blocks: bool = False,
        step_cache: bool = False,
        checkpoints: bool = False,
    ) -> None:
        super().__init__(
            step_seconds=step_seconds,
            fail_at_step=fail_at_step,
            max_batch_size=max_batch_size,
            suspendable=suspendable,
            frames=frames,
            blocks=blocks,
            step_cache=step_cache,
            checkpoints=checkpoints,
        )
        if gate_blocks and not blocks:
            raise ValueError("gate_blocks: needs blocks > 0")
        self.gate_timeout = gate_timeout
        self.gate_decodes = gate_decodes
        self.gate_blocks = gate_blocks
        self.arrived = 0
        self.decodes_arrived = 0
        self._permits = 0
        self._decode_permits = 0
        self._open = False

    def release(self, n: int = 1) -> None:
        """Let ``n`` more steps run; never blocks."""
        with self._changed:
            self._permits += n
            self._changed.notify_all()

    def open_gate(self) -> None:
        """Let every step from now on run without a release."""
        with self._changed:
            self._open = True
            self._changed.notify_all()

    def release_decode(self, n: int = 1) -> None:
        """Let ``n`` more decodes run (with ``gate_decodes``); never blocks."""
        with self._changed:
            self._decode_permits += n
            self._changed.notify_all()

    def step(self, states: Sequence[FakeState]) -> None:
        """Wait for a release (each block's, with ``gate_blocks``), then step as ``FakeRunner``."""
        if not self.gate_blocks:
            self._wait_step_gate("a step")
        super().step(states)

    def _block(self) -> None:
        if self.gate_blocks:
            self._wait_step_gate("a block")
        super()._block()

    def _wait_step_gate(self, what: str) -> None:
        with self._changed:
            self.arrived += 1
            self._changed.notify_all()
            if not self._changed.wait_for(
                lambda: self._open or self._permits > 0, self.gate_timeout
            ):
                raise RuntimeError(f"GatedRunner: no release() came for {what}")
            if not self._open:
                self._permits -= 1

    def decode(self, state: FakeState) -> torch.Tensor:
        """Wait for ``release_decode`` with ``gate_decodes`` (each chunk's, with ``blocks``)."""
        if self.gate_decodes and not self.blocks:
            self._wait_decode_gate("a decode")
        return super().decode(state)

    def _chunk(self) -> None:
        if self.gate_decodes:
            self._wait_decode_gate("a chunk")

    def _wait_decode_gate(self, what: str) -> None:
        with self._changed:
            self.decodes_arrived += 1
            self._changed.notify_all()
            if not self._changed.wait_for(lambda: self._decode_permits > 0, self.gate_timeout):
                raise RuntimeError(f"GatedRunner: no release_decode() came for {what}")
            self._decode_permits -= 1

    async def wait_arrived(self, n: int) -> None:
        """Wait until ``n`` steps in all have reached the gate.

        Cancellation:
            Safe; compose with ``anyio.fail_after`` for a bound.
        """
        while self.arrived < n:
            await anyio.sleep(0.001)
