"""omni_trio: a structured-concurrency serving engine for diffusion models.

Every request lives in a scope; the denoise loop runs in one owned worker thread
per device and checks a cancellation token at every step boundary; each request's
events travel over its own channel. See ``open_engine``.
"""

from __future__ import annotations

from ._config import EngineConfig as EngineConfig
from ._config import GenerationRequest as GenerationRequest
from ._engine import Engine as Engine
from ._engine import open_engine as open_engine
from ._errors import DuplicateRequestError as DuplicateRequestError
from ._errors import EngineClosedError as EngineClosedError
from ._errors import EngineDeadError as EngineDeadError
from ._errors import InvalidRequestError as InvalidRequestError
from ._errors import OmniTrioError as OmniTrioError
from ._errors import QueueFullError as QueueFullError
from ._errors import RequestAbortedError as RequestAbortedError
from ._errors import RequestError as RequestError
from ._errors import RequestFailedError as RequestFailedError
from ._handle import RequestHandle as RequestHandle
from ._types import EngineStatistics as EngineStatistics
from ._types import GenerationOutput as GenerationOutput
from ._types import RequestMetrics as RequestMetrics
from ._types import RequestStatus as RequestStatus
from ._types import StepEvent as StepEvent

__version__ = "0.1.0"

__all__ = [
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStatistics",
    "GenerationOutput",
    "GenerationRequest",
    "InvalidRequestError",
    "OmniTrioError",
    "QueueFullError",
    "RequestAbortedError",
    "RequestError",
    "RequestFailedError",
    "RequestHandle",
    "RequestMetrics",
    "RequestStatus",
    "StepEvent",
    "open_engine",
]
