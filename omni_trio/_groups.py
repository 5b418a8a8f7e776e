"""Groups of samples of one prompt (L101): one call, G requests of their own.

Group-relative RL (Flow-GRPO, DanceGRPO) scores G samples of each prompt against each
other. ``generate_group`` submits them together, in one go, so the engine batches them
(the same batch key: they differ only by seed), and each is a request of its own: its
own id (``"<group>/<index>"``), abortable alone (``Engine.abort``), preempted, resumed
and held to its deadline alone, as any request is. The result says what became of each:
a group some of whose samples were aborted, failed or refused is reported as partial,
with each such sample's reason; no sample is ever made up to fill it.

Seeds: given one by one, or derived from the request's seed (or, without one, a fresh
random one that the result reports), by ``group_seeds``: the same seed gives the same
group, and every sample another seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

import anyio

from ._errors import (
    EngineClosedError,
    EngineDeadError,
    OmniTrioError,
    RequestAbortedError,
    RequestError,
    RequestFailedError,
)
from ._reasons import AbortReason
from ._request import GenerationRequest
from ._validate import check_int, check_request_id, fail_request

if TYPE_CHECKING:
    from ._engine import Engine
    from ._handle import RequestHandle
    from ._outputs import GenerationOutput

__all__ = [
    "MAX_GROUP_SIZE",
    "GroupResult",
    "GroupSample",
    "SampleOutcome",
    "generate_group",
    "group_seeds",
]

#: What became of one sample: its output, an abort, a failure, or no admission.
SampleOutcome: TypeAlias = Literal["completed", "aborted", "failed", "refused"]

#: The most samples one group takes: more than any group-relative trainer draws per
#: prompt (8 to 24), few enough that a hostile number never sizes a loop.
MAX_GROUP_SIZE = 1024

_SEED_LIMIT = 2**64


def group_seeds(seed: int, count: int) -> tuple[int, ...]:
    """The seeds of a group of ``count`` samples derived from ``seed``: each the first 63
    bits of ``SHA-256("omni_trio group <seed> <index>")``, so consecutive group seeds
    share no sample seeds."""
    return tuple(
        int.from_bytes(hashlib.sha256(f"omni_trio group {seed} {index}".encode()).digest()[:8]) >> 1
        for index in range(count)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSample:
    """One sample of a group: its request, and what became of it (L101).

    ``output`` is set for a completed sample only. ``reason`` is an aborted sample's
    abort reason (``"user"``, ``"deadline"``, ``"shutdown"``, ...). ``error`` is what
    a sample that did not complete raised (``RequestAbortedError``,
    ``RequestFailedError``, ``EngineClosedError``, ``EngineDeadError``) or, refused,
    what its ``submit`` raised (``QueueFullError``, ``DeadlineError``, ...).
    """

    index: int
    request_id: str
    seed: int
    outcome: SampleOutcome
    output: GenerationOutput | None = None
    reason: str | None = None
    error: OmniTrioError | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """What a group became: every sample, in order, each with its outcome (L101).

    ``seed`` is the seed the samples' seeds were derived from (``None`` where they were
    given).
    """

    group_id: str
    seed: int | None
    samples: tuple[GroupSample, ...]

    @property
    def is_partial(self) -> bool:
        """Whether some sample did not complete."""
        return any(sample.outcome != "completed" for sample in self.samples)

    @property
    def completed(self) -> tuple[GroupSample, ...]:
        """The samples that completed, in order."""
        return tuple(sample for sample in self.samples if sample.outcome == "completed")

    @property
    def outputs(self) -> tuple[GenerationOutput, ...]:
        """The outputs of the samples that completed, in order (never padded)."""
        return tuple(s.output for s in self.samples if s.output is not None)


def _seeds(
    request: GenerationRequest, n: int | None, seeds: Sequence[int] | None
) -> tuple[tuple[int, ...], int | None]:
    """The samples' seeds and the seed they came from (``None``: given)."""
    if seeds is not None:
        if isinstance(seeds, str | bytes) or not isinstance(seeds, Sequence):
            fail_request("seeds", f"must be a sequence of ints, got {type(seeds).__name__}")
        given = tuple(
            check_int(fail_request, "seeds", seed, minimum=0, maximum=_SEED_LIMIT - 1)
            for seed in seeds
        )
        if not 1 <= len(given) <= MAX_GROUP_SIZE:
            fail_request("seeds", f"must hold 1 to {MAX_GROUP_SIZE} seeds, got {len(given)}")
        if n is not None and n != len(given):
            fail_request("n", f"is {n}, but {len(given)} seeds are given")
        return given, None
    if n is None:
        fail_request("n", "give the group's size, or its seeds")
    count = check_int(fail_request, "n", n, minimum=1, maximum=MAX_GROUP_SIZE)
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return group_seeds(seed, count), seed


def _ended(index: int, handle: RequestHandle, seed: int, exc: OmniTrioError) -> GroupSample:
    """The sample whose ``result()`` raised ``exc``."""
    match exc:
        case RequestAbortedError():
            outcome: SampleOutcome = "aborted"
            reason: str | None = exc.reason
        case EngineClosedError():
            outcome, reason = "aborted", AbortReason.SHUTDOWN
        case _:
            outcome, reason = "failed", None
    return GroupSample(
        index=index,
        request_id=handle.request_id,
        seed=seed,
        outcome=outcome,
        reason=reason,
        error=exc,
    )


async def generate_group(
    engine: Engine,
    request: GenerationRequest,
    *,
    n: int | None = None,
    seeds: Sequence[int] | None = None,
    group_id: str | None = None,
) -> GroupResult:
    """Generate ``n`` samples of ``request``, each a request of its own, submitted at once
    so that they batch; wait for all of them (L101).

    Sample ``i`` is ``request`` with the ``i``-th seed, under the id ``"<group_id>/<i>"``:
    abort one by that id (``Engine.abort``), and the others go on. Each has the
    request's deadline, priority and tenant.

    Args:
        engine: the engine to run them on.
        request: what every sample generates; its ``seed``, where set, is the group's
            (``group_seeds`` derives the samples' from it); without one, a fresh random
            seed is drawn (``GroupResult.seed`` reports it).
        n: how many samples, 1 to ``MAX_GROUP_SIZE``.
        seeds: the samples' own seeds instead (``n``, if given, must be their count).
        group_id: the prefix of the samples' ids; a fresh unique one by default.

    Returns:
        Every sample, in order, with its output or why it has none: a partial group
        says so (``is_partial``).

    Raises:
        InvalidRequestError: ``n``, ``seeds`` or ``group_id`` is invalid, or the first
            sample is refused as invalid (``field`` names why).
        RequestError: what ``submit`` raised for the first sample (nothing was admitted):
            ``QueueFullError``, ``DeadlineError``, ``DuplicateRequestError``. A later
            sample refused is reported (outcome ``"refused"``), not raised.
        EngineClosedError: shutdown has begun (nothing was admitted).
        EngineDeadError: the worker died (nothing was admitted).

    Cancellation:
        Cancelling the caller aborts every sample still live (reason ``cancelled``)
        and returns only after the engine released them all (L11).
    """
    chosen, seed = _seeds(request, n, seeds)
    prefix = f"group-{uuid.uuid4().hex}" if group_id is None else check_request_id(group_id)
    samples: list[GroupSample | None] = [None] * len(chosen)
    async with contextlib.AsyncExitStack() as stack:
        handles: list[tuple[int, RequestHandle]] = []
        # Every sample is submitted before the first wait: they queue together.
        for index, own in enumerate(chosen):
            request_id = f"{prefix}/{index}"
            try:
                handle = engine.submit(
                    dataclasses.replace(request, seed=own), request_id=request_id
                )
            except (RequestError, EngineClosedError, EngineDeadError) as exc:
                if not handles or isinstance(exc, EngineDeadError):
                    raise
                samples[index] = GroupSample(
                    index=index, request_id=request_id, seed=own, outcome="refused", error=exc
                )
                continue
            stack.push_async_exit(handle)
            handles.append((index, handle))

        async def wait(index: int, handle: RequestHandle) -> None:
            try:
                output = await handle.result()
            except (
                RequestAbortedError,
                RequestFailedError,
                EngineClosedError,
                EngineDeadError,
            ) as exc:
                samples[index] = _ended(index, handle, chosen[index], exc)
            else:
                samples[index] = GroupSample(
                    index=index,
                    request_id=handle.request_id,
                    seed=chosen[index],
                    outcome="completed",
                    output=output,
                )

        async with anyio.create_task_group() as group:
            for index, handle in handles:
                group.start_soon(wait, index, handle)
    finished = tuple(sample for sample in samples if sample is not None)
    assert len(finished) == len(samples)
    return GroupResult(group_id=prefix, seed=seed, samples=finished)
