"""Checkpoints of a running request (L78): what the engine hands out, and their envelope.

A runner that declares ``checkpoints`` (``RunnerCapabilities.checkpoints``) can
copy a request's state at a step boundary and later rebuild it in a fresh
process: the suspended state of preemption (L61), as bytes. The engine's part:

- ``Engine.submit(request, checkpoint=CheckpointPolicy(every_s, sink))``: at a step
  boundary at least ``every_s`` after the last one, the worker asks the runner for
  a copy (``CheckpointRunner.checkpoint``: a copy of the tensors, cheap) and hands it
  to its materializer thread, which turns it into bytes
  (``checkpoint_bytes``) and calls ``sink(Checkpoint(...))`` there. The step loop
  never waits for a serialization, a disk or the event loop;
- ``Engine.submit(request, resume_from=data)``: the worker calls the runner's
  ``restore`` instead of ``prepare``; a checkpoint the runner refuses (corrupt, or
  of another model, version or request: ``CheckpointError``) is logged and the
  request starts from step 0.

The envelope (``pack_checkpoint``/``unpack_checkpoint``) is the runner's to use: a
magic line, a JSON header (format, omni_trio's version, the model's key, the request's
fingerprint (``_codec.request_fingerprint``), the step) and a SHA-256 of the payload, so
a checkpoint that is cut short, flipped or foreign is refused by name, never loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _version as _package
from ._codec import request_fingerprint

if TYPE_CHECKING:
    from ._request import GenerationRequest

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointPolicy",
    "pack_checkpoint",
    "unpack_checkpoint",
]

#: The first bytes of every checkpoint, and the envelope's format number.
MAGIC = b"omni-trio-checkpoint\n"
FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint that cannot be restored: corrupt, or of another model, version or request.

    The message says which; the engine logs it and starts the request from step 0.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A request's state after ``step`` of ``total`` steps, as bytes (L78).

    Args:
        request_id: the request's id.
        step: the steps done when it was taken.
        total: the steps the request runs.
        data: what ``Engine.submit(..., resume_from=data)`` takes.
    """

    request_id: str
    step: int
    total: int
    data: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPolicy:
    """How often a request is checkpointed, and who takes the checkpoints.

    Args:
        every_s: seconds between two checkpoints, at least (0: at every step
            boundary); the first comes ``every_s`` after the request's first step.
        sink: called with each ``Checkpoint``, in the engine's materializer thread
            (never the event loop's): it must be quick and thread-safe (hand the
            bytes to a writer); what it raises is logged and the request goes on.

    Raises:
        ValueError: ``every_s`` is negative or not finite.
    """

    every_s: float
    sink: Callable[[Checkpoint], None]

    def __post_init__(self) -> None:
        every = self.every_s
        if isinstance(every, bool) or not isinstance(every, int | float) or not 0 <= every < 1e9:
            raise ValueError(f"every_s: must be a number of seconds >= 0, got {every!r}")


def _version() -> str:
    return _package.__version__  # read at each call: a test may stand in another


def pack_checkpoint(payload: bytes, *, model: str, request: GenerationRequest, step: int) -> bytes:
    """Wrap a runner's ``payload`` in the envelope: what it is, for what, and its digest."""
    header = {
        "format": FORMAT,
        "version": _version(),
        "model": model,
        "request": request_fingerprint(request),
        "step": step,
    }
    text = json.dumps(header, sort_keys=True).encode()
    digest = hashlib.sha256(payload).digest()
    return MAGIC + len(text).to_bytes(4, "big") + text + digest + payload


def unpack_checkpoint(data: bytes, *, model: str, request: GenerationRequest) -> tuple[bytes, int]:
    """The payload and the step of a checkpoint ``pack_checkpoint`` made for this model, request.

    Raises:
        CheckpointError: it is not a checkpoint, is cut short or altered, or was
            made by another omni_trio version, for another model or request.
    """
    if not isinstance(data, bytes) or not data.startswith(MAGIC):
        raise CheckpointError("not an omni_trio checkpoint")
    start = len(MAGIC)
    length = int.from_bytes(data[start : start + 4], "big")
    try:
        header = json.loads(data[start + 4 : start + 4 + length])
    except ValueError:
        raise CheckpointError("its header is unreadable (a cut or altered file)") from None
    body = start + 4 + length
    digest, payload = data[body : body + 32], data[body + 32 :]
    if not isinstance(header, dict):
        raise CheckpointError("its header is unreadable (a cut or altered file)")
    expected = {"format": FORMAT, "version": _version(), "model": model}
    for name, value in expected.items():
        if header.get(name) != value:
            raise CheckpointError(f"made for {name} {header.get(name)!r}, this is {value!r}")
    if header.get("request") != request_fingerprint(request):
        raise CheckpointError("made for another request (its fields differ)")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("its payload does not match its digest (a cut or altered file)")
    step = header.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"its step is not a count: {step!r}")
    return payload, step
