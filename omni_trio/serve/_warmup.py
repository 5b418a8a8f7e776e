"""The warm-up: one small request before the server answers, so every step is bounded.

``EngineConfig.max_step_s`` (L4) refuses a request whose one step would outlast it,
by what a worker measured of warm steps of shapes no larger than the request's
(``_steptimes``); before a worker has measured such a shape, it admits whatever the
other limits admit. ``ServeConfig.warm_up`` runs one request at the default size
(one frame of a video model, a grey picture for a model that starts from one),
inside the lifespan and before it yields, of enough steps to measure that shape
warm (``WARM_UP_STEPS``, or the fewest the model runs if more): a device so slow
that even that step outlasts the bound refuses the first client's request of that
size or larger, rather than hold its worker past any abort, deadline or shutdown.

With several workers, the warm-up measures the one it runs on; the bound applies
once every worker has measured a shape (the first requests spread over them).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from .._engine import Engine
from .._request import GenerationRequest
from .._runner import RunnerCapabilities
from .._steptimes import COLD_STEPS, MIN_WARM
from ._config import ServeConfig

__all__ = ["WARM_UP_ID", "warm_up", "warm_up_request"]

_log = logging.getLogger("omni_trio.serve")

#: The warm-up request's id (a client's id is never this: clients get generated ids).
WARM_UP_ID = "omni_trio-warm-up"

#: The warm-up's steps: its shape's cold ones and enough warm ones to count.
WARM_UP_STEPS = COLD_STEPS + MIN_WARM


def warm_up_request(capabilities: RunnerCapabilities, config: ServeConfig) -> GenerationRequest:
    """The cheapest request of the server's default size that measures its step warm."""
    height, width = capabilities.fixed_size or (config.default_height, config.default_width)
    most = capabilities.max_steps
    steps = max(capabilities.min_steps, WARM_UP_STEPS if most is None else min(WARM_UP_STEPS, most))
    request = GenerationRequest(
        prompt="warm-up", num_steps=steps, height=height, width=width, seed=0
    )
    if capabilities.frames is not None:
        period, remainder = capabilities.frames
        request = dataclasses.replace(request, num_frames=remainder or period)
    if capabilities.image_to_video:
        import torch  # only a model that starts from a picture needs it here

        request = dataclasses.replace(request, image=torch.full((3, height, width), 0.5))
    return request


async def warm_up(engine: Engine, request: GenerationRequest) -> None:
    """Run ``request`` to its end and log how long it took; a failure is logged, not raised.

    A model that fails its warm-up will fail its clients' requests too, and they say so
    to each of them; the server still starts, to answer ``/health`` and ``/metrics``.
    """
    start = time.perf_counter()
    try:
        await engine.generate(request, request_id=WARM_UP_ID)
    except Exception as exc:
        _log.error("warm-up request failed (%s); serving without it", type(exc).__name__)
        return
    _log.info(
        "warm-up: %d step(s) of %dx%d in %.2f s; steps longer than max_step_s are refused now",
        request.num_steps,
        request.width,
        request.height,
        time.perf_counter() - start,
    )
