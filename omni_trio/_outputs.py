"""The data that the engine hands out: statuses, events, outputs, metrics, statistics."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from ._mp4 import write_mp4
from ._results import ResultCacheStatistics
from ._sampling import Trajectory
from ._stepcache import CacheMetrics, PromptCacheMetrics
from ._weights import WeightVersion

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

__all__ = [
    "EngineStatistics",
    "GenerationOutput",
    "RequestMetrics",
    "RequestStatus",
    "RequestTimeline",
    "StepEvent",
    "WorkerStatistics",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life; the last three are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        """Whether nothing more will happen to a request in this status."""
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True, slots=True, kw_only=True, weakref_slot=True)
class StepEvent:
    """One denoise step done: ``step`` steps of ``total`` are complete.

    ``preview`` is a small CPU float32 tensor ``[N, C, h, w]`` in [0, 1] (``C`` 1, 3
    or 4; the diffusers runners make RGB) on every
    ``preview_every``-th step of a request whose consumer reads its events, and
    ``None`` otherwise.
    """

    request_id: str
    step: int
    total: int
    preview: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestTimeline:
    """When a request's life happened, for a trace of it (L99).

    ``admitted_ns`` is the wall clock (``time.time_ns()``) at its admission; the rest
    are seconds after it, on the engine's monotonic clock: ``runs`` each run segment
    on its worker (from a take or a resume to a suspension, its last step or its
    release: a suspended request, L61, has several), ``denoised_s`` its last step's end
    (``None``: it never got there), ``ended_s`` the moment it became terminal.
    """

    admitted_ns: int
    runs: tuple[tuple[float, float], ...]
    denoised_s: float | None
    ended_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestMetrics:
    """Where a request's time went, filled for every terminal outcome.

    Times are seconds. ``exec_s`` runs from the worker taking the request to its
    last denoise step; ``output_ready_wait_s`` is the time after that until the
    output was ready for the consumer (decode, device-to-host copy, hand-off), and
    is counted in neither ``exec_s`` nor ``stage_durations``.
    ``abort_latency_s`` is the time from the abort request to the release of the
    request's state, and ``steps_after_abort`` the denoise steps the worker ran for
    it after the abort was asked (0 or 1: a step in flight), for aborted requests
    only. ``preemptions`` counts the times it was suspended (L61) and
    ``suspended_s`` the time it spent so; ``exec_s`` includes that time.
    ``cache`` says what its step cache did (L84: row-calls and row-blocks computed
    and skipped, the threshold it ended with, whether it was loosened); ``None``
    for a request without a policy (or one whose runner did not say).
    ``prompt_cache`` says what the runner's prompt-embedding cache did for its texts
    (L94: hits, misses, the text encoders' seconds on the misses and the seconds the
    hits saved); ``None`` when its runner has no such cache (or did not say), and for
    a request that never ran (a result-cache hit, one aborted while it waited).
    ``timeline`` says when each part of its life happened (a trace's spans, L99).
    ``result_cache_hit`` says that its output came from the engine's result cache
    (L95, L96): it never reached a worker, so ``steps_done`` is 0 and its time is all
    ``queue_wait_s`` (its admission).
    ``weight_version`` names the weights it ran on (L102): those of the engine when a
    worker took it (a hit: when it was admitted), ``None`` if it never ran.
    """

    queue_wait_s: float
    exec_s: float
    output_ready_wait_s: float
    stage_durations: Mapping[str, float]
    steps_done: int
    total_s: float
    abort_latency_s: float | None = None
    steps_after_abort: int | None = None
    preemptions: int = 0
    suspended_s: float = 0.0
    cache: CacheMetrics | None = None
    prompt_cache: PromptCacheMetrics | None = None
    timeline: RequestTimeline | None = None
    result_cache_hit: bool = False
    weight_version: WeightVersion | None = None


@dataclass(frozen=True, slots=True, kw_only=True, weakref_slot=True)
class GenerationOutput:
    """A finished request's images: a CPU float tensor ``[N, C, H, W]`` in [0, 1].

    For a video request (``num_frames`` set, L70) ``video`` is the CPU float tensor
    ``[N, F, C, H, W]`` in [0, 1] and ``images`` its first frames (``video[:, 0]``, a
    view, no copy), so what reads images (``to_pil``, the HTTP answer) shows a
    still; for an image request ``video`` is ``None``. ``trajectory`` is the request's
    trajectory (each step's latents, the noise drawn, the timesteps, the transition
    log-probabilities, L100) where it asked for one (``return_trajectory``), else ``None``.
    """

    request_id: str
    images: torch.Tensor
    metrics: RequestMetrics
    video: torch.Tensor | None = None
    trajectory: Trajectory | None = None

    @property
    def weight_version(self) -> WeightVersion | None:
        """The weights it was made with (L102): ``metrics.weight_version``."""
        return self.metrics.weight_version

    def save_video(
        self, path: str | os.PathLike[str] | BinaryIO, fps: float = 24.0, *, index: int = 0
    ) -> None:
        """Write video ``index`` as an H.264 MP4 (``yuv420p``, what every player reads).

        Needs PyAV (``pip install 'omni_trio[video]'``), imported only when a video is
        written (``_mp4``). Grey frames are written as RGB, an alpha channel is dropped.

        Args:
            path: the file to write (replaced if it exists), or a writable,
                seekable binary file object (``io.BytesIO``) to write the MP4 into.
            fps: frames per second, finite and > 0 (stored as an exact fraction,
                so 24000/1001 can be given as ``Fraction(24000, 1001)``).
            index: which of the request's ``num_images`` videos.

        Raises:
            ValueError: this output is not a video, ``index`` or ``fps`` is out of
                range, or a side is odd (H.264's ``yuv420p`` needs even sides).
            ImportError: PyAV is not installed.
        """
        if self.video is None:
            raise ValueError("save_video: this output is an image (its request had no num_frames)")
        if not 0 <= index < self.video.shape[0]:
            raise ValueError(f"save_video: index {index} out of range for {self.video.shape[0]}")
        write_mp4(self.video[index], path, fps)

    def to_pil(self) -> list[Image]:
        """Convert the images to PIL images (RGB, or L for one channel)."""
        import torch
        from PIL import Image as PILImage

        array = (self.images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
        # A 2-D uint8 array becomes an "L" image, a [H, W, 3] one "RGB".
        return [
            PILImage.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
            for image in array.numpy()
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatistics:
    """One worker's counts at one moment (L43): ``running`` members in its batch now.

    ``holding`` names the requests its threads hold now (its batch's members, and the
    one it decodes) and ``in_step_s`` how long its current denoise step has run
    (``None`` between steps): what a server that must leave while a step does not
    return says it leaves behind.
    """

    name: str
    alive: bool
    running: int
    steps_run: int
    batch_steps: int
    preemptions: int
    holding: tuple[str, ...] = ()
    in_step_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatistics:
    """Counts at one moment; ``admitted`` always equals the sum of the five statuses.

    ``suspended`` counts the waiting requests that were suspended (L61) and hold
    parked state; ``preemptions`` every suspension so far; ``steps_after_abort``
    the member-steps run for requests after their abort was asked, summed.
    ``workers_alive`` counts the workers whose threads have not died (L43), and
    ``workers`` holds each worker's own counts, in the order of the runners.
    ``result_cache`` says what the result cache did (L95); ``None`` without one.
    """

    admitted: int
    waiting: int
    running: int
    completed: int
    aborted: int
    failed: int
    steps_run: int
    batch_steps: int
    is_closing: bool
    is_dead: bool
    suspended: int = 0
    preemptions: int = 0
    steps_after_abort: int = 0
    workers_alive: int = 1
    workers: tuple[WorkerStatistics, ...] = ()
    result_cache: ResultCacheStatistics | None = None
