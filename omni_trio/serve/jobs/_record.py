"""A video job's records: its parameters as JSON data and back, its error, its MP4 bytes.

What a store keeps of a job is plain data (``_store.JobRow``): ``spec_record`` writes a
job's parameters (the request, every field, by ``omni_trio._codec``), ``spec_from_record``
reads them back, ``error_record`` is a failed job's error, ``encode_mp4`` the bytes of
a completed one.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._codec import request_from_record, request_record
from .._errors import ApiError
from .._video_body import VideoSpec

if TYPE_CHECKING:
    from ..._outputs import GenerationOutput

__all__ = ["encode_mp4", "error_record", "spec_from_record", "spec_record", "storage_error"]


def error_record(error: ApiError) -> dict[str, str]:
    """A failed job's ``error``: the API error's code and message."""
    return {"code": error.code or "failed", "message": error.message}


def storage_error() -> ApiError:
    """A job's error when the store could not keep its video (the server's log says why)."""
    return ApiError(
        500,
        "the video could not be stored (the server's disk or store failed); create the job again",
        type="server_error",
        code="storage_error",
    )


def spec_record(spec: VideoSpec) -> dict[str, Any]:
    """What the store keeps of a job's parameters (JSON data): the request, every field
    (``_codec``), and the video's own; ``spec_from_record`` reads it."""
    return {
        "size": spec.size,
        "seconds": spec.seconds,
        "fps": spec.fps,
        "request": request_record(spec.request),
    }


def spec_from_record(data: Any) -> VideoSpec:
    """The ``VideoSpec`` the store kept (``spec_record``); a deadline does not survive.

    Raises:
        Exception: the record is not one ``spec_record`` wrote (a ``KeyError``, a
            ``TypeError``, a ``ValueError``, an ``InvalidRequestError``).
    """
    request = request_from_record(data["request"])
    return VideoSpec(
        request=dataclasses.replace(request, deadline_s=None),
        size=str(data["size"]),
        seconds=str(data["seconds"]),
        fps=float(data["fps"]),
    )


def encode_mp4(
    output: GenerationOutput, fps: float, hold: Callable[[str], None] | None = None
) -> bytes:
    """The output's first video as MP4 bytes (H.264, ``yuv420p``; a worker thread's work).

    ``hold``: a durable store's test hook (``JobStore.hold``), called at ``encode``.
    """
    if hold is not None:
        hold("encode")
    data = io.BytesIO()
    output.save_video(data, fps)
    return data.getvalue()
