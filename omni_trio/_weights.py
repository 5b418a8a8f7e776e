"""Weights in place and sleep (L102, L103): the data, the errors and the runner's side.

The engine updates a model's weights while it serves (``Engine.update_weights``): at
a step boundary of every worker, with nothing in flight on the old weights (the
running requests finish first, or are aborted with reason ``weights_updated``), on
every runner all or nothing; each output then names the ``WeightVersion`` it ran on.
``Engine.sleep`` frees the weights' device memory between rollouts (level 1: moved
to host memory; level 2: dropped where the model's files hold them, and read again
at ``Engine.wake``) once the running requests finished or were suspended.

A runner takes part by implementing ``WeightsRunner`` (``DiffusersRunner`` and
``ParallelRunner`` do): five calls, made from anyio's worker threads while no
request of the runner runs. An update is two-phase, so that the engine can keep it
all or nothing across its runners: ``update_weights`` applies it and keeps what it
replaced, then ``commit_weights`` forgets that, or ``revert_weights`` puts it back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, get_args

from ._errors import OmniTrioError

if TYPE_CHECKING:
    from ._runner import Runner

__all__ = [
    "SLEEP_POLICIES",
    "UPDATE_POLICIES",
    "EngineSleepingError",
    "SleepBytes",
    "SleepPolicy",
    "SleepReport",
    "UpdatePolicy",
    "WakeReport",
    "WeightSource",
    "WeightVersion",
    "WeightsError",
    "WeightsReason",
    "WeightsRunner",
    "is_weights_runner",
]

#: What ``update_weights`` takes: a ``.safetensors`` file, or a state dict (tensor
#: names to tensors: the denoiser's, or each key prefixed ``component.``), or a
#: mapping of component names to state dicts. A LoRA (its keys name ``lora_A`` /
#: ``lora_B``, or ``lora_down`` / ``lora_up``) is applied as the base adapter of every
#: request, unmerged (see ``DiffusersRunner.update_weights``).
WeightSource: TypeAlias = "str | os.PathLike[str] | Mapping[str, Any]"

#: What becomes of the requests in flight at an update (L102): they ``finish`` on
#: the old weights first (new ones wait), or they are aborted (``weights_updated``).
UpdatePolicy: TypeAlias = Literal["finish", "abort"]
UPDATE_POLICIES: tuple[str, ...] = get_args(UpdatePolicy)

#: What becomes of the requests in flight at a sleep (L103): they ``finish`` first, or
#: they are suspended exactly (L61) and resume after the wake.
SleepPolicy: TypeAlias = Literal["finish", "suspend"]
SLEEP_POLICIES: tuple[str, ...] = get_args(SleepPolicy)

#: Why an update, a sleep or a wake was refused: a source that does not fit the model
#: (``invalid``), an engine or runner that cannot (``unsupported``), an engine asleep
#: (``asleep``: wake it first), a runner that failed while applying it (``failed``: every
#: runner is back on the weights it had).
WeightsReason: TypeAlias = Literal["invalid", "unsupported", "asleep", "failed"]


class WeightsError(OmniTrioError):
    """An update of the weights, a sleep or a wake could not be done; ``reason`` says why.

    Nothing changed: every runner serves the weights it had.
    """

    def __init__(self, message: str, *, reason: WeightsReason) -> None:
        super().__init__(message)
        self.reason: WeightsReason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuilt, (str(self), self.reason))


def _rebuilt(message: str, reason: WeightsReason) -> WeightsError:
    return WeightsError(message, reason=reason)


class EngineSleepingError(OmniTrioError):
    """The engine sleeps and refuses new requests (``Engine.sleep(refuse=True)``, L103);
    a server answers 503. Retry after ``Engine.wake``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightVersion:
    """The weights a request ran on (L102).

    Args:
        number: 0 for the weights the engine opened with, then one more per update.
        label: what the caller named the update (``update_weights(label=...)``), or
            ``None``.
    """

    number: int
    label: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepBytes:
    """What one runner's ``sleep_weights`` freed on its device (L103).

    Args:
        offloaded: bytes moved to host memory.
        dropped: bytes let go of, read again from the model's files at the wake.
        kept: bytes left on the device (a weight it cannot move: a quantized one).
    """

    offloaded: int = 0
    dropped: int = 0
    kept: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SleepReport:
    """What ``Engine.sleep`` did (L103), summed over its runners.

    Args:
        level: 1 or 2.
        offloaded_bytes: the weights' bytes moved to host memory.
        dropped_bytes: the weights' bytes dropped (level 2), read again at the wake.
        kept_bytes: the bytes left on the devices.
        drain_s: seconds until no request ran (they finished or were suspended).
        sleep_s: seconds the runners took to free their weights.
    """

    level: int
    offloaded_bytes: int
    dropped_bytes: int
    kept_bytes: int
    drain_s: float
    sleep_s: float

    @property
    def freed_bytes(self) -> int:
        """The device bytes freed: offloaded and dropped."""
        return self.offloaded_bytes + self.dropped_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class WakeReport:
    """What ``Engine.wake`` did (L103): ``level`` 0 when the engine was awake already.

    Args:
        level: the level it slept at.
        wake_s: seconds the runners took to bring their weights back.
    """

    level: int
    wake_s: float


class WeightsRunner(Protocol):
    """A runner whose weights can be updated in place and put to sleep (L102, L103).

    The engine calls these from anyio's worker threads, only while none of the
    runner's requests runs (its worker waits at a step boundary): the runner never
    has to guard a step against them. One update at a time: ``update_weights``, then
    ``commit_weights`` or ``revert_weights``, before the next.
    """

    def update_weights(self, source: WeightSource, *, key: str) -> None:
        """Apply ``source`` (see ``WeightSource``), keeping what it replaced.

        ``key`` names the new weights: the runner puts it in what names its model
        (its checkpoints' key, L78), so nothing made on other weights is taken for
        theirs.

        Raises:
            WeightsError: ``source`` does not fit the model; nothing changed.
        """
        ...

    def commit_weights(self) -> None:
        """Forget what the last ``update_weights`` replaced."""
        ...

    def revert_weights(self) -> None:
        """Put back what the last ``update_weights`` replaced (another runner refused it)."""
        ...

    def sleep_weights(self, level: int) -> SleepBytes:
        """Free the weights' device memory: level 1 moves them to host memory, level 2
        drops those the model's files hold (and moves the rest)."""
        ...

    def wake_weights(self) -> None:
        """Bring the weights back where they were, bit for bit; nothing when awake.

        Raises:
            WeightsError: a file a level-2 sleep dropped weights of changed or is gone;
                the runner stays asleep.
        """
        ...


def is_weights_runner(runner: Runner[Any]) -> bool:
    """Whether ``runner`` implements ``WeightsRunner`` (its five calls)."""
    calls = ("update_weights", "commit_weights", "revert_weights", "sleep_weights", "wake_weights")
    return all(callable(getattr(runner, name, None)) for name in calls)
