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
import functools
import logging
import time
from collections.abc import Callable, Sequence

import anyio

from .._engine import Engine
from .._request import GenerationRequest
from .._runner import RunnerCapabilities
from .._steptimes import COLD_STEPS, MIN_WARM
from ._config import ServeConfig

__all__ = ["WARM_UP_ID", "warm_up", "warm_up_request", "warm_up_requests"]

_log = logging.getLogger("omni_trio.serve")

#: The warm-up request's id (a client's id is never this: clients get generated ids).
WARM_UP_ID = "omni_trio-warm-up"

#: The warm-up's steps: its shape's cold ones and enough warm ones to count.
WARM_UP_STEPS = COLD_STEPS + MIN_WARM


def warm_up_request(
    capabilities: RunnerCapabilities,
    config: ServeConfig,
    size: tuple[int, int] | None = None,
) -> GenerationRequest:
    """The cheapest request of ``size`` (width, height; the server's default size) that
    measures its step warm."""
    width, height = size or (config.default_width, config.default_height)
    height, width = capabilities.fixed_size or (height, width)
    most = capabilities.max_steps
    steps = max(capabilities.min_steps, WARM_UP_STEPS if most is None else min(WARM_UP_STEPS, most))
    # No seed: a result cache (L95) never answers it, so it runs and warms.
    request = GenerationRequest(prompt="warm-up", num_steps=steps, height=height, width=width)
    if capabilities.frames is not None:
        period, remainder = capabilities.frames
        request = dataclasses.replace(request, num_frames=remainder or period)
    if capabilities.image_to_video:
        import torch  # only a model that starts from a picture needs it here

        request = dataclasses.replace(request, image=torch.full((3, height, width), 0.5))
    return request


def warm_up_requests(
    capabilities: RunnerCapabilities, config: ServeConfig
) -> list[GenerationRequest]:
    """The warm-up's requests: one per size the server declares (``warm_up_sizes``), or one
    of its default size."""
    sizes = config.warm_up_sizes or ((config.default_width, config.default_height),)
    return [warm_up_request(capabilities, config, size) for size in sizes]


async def warm_up(
    engine: Engine,
    requests: GenerationRequest | Sequence[GenerationRequest],
    *,
    together: int = 1,
    seal: Callable[[], None] | None = None,
) -> None:
    """Run each of ``requests`` to its end, alone, then ``together`` copies of it at once (a
    compiled model's batch graphs, L90); then ``seal`` (from then on a shape without a
    compiled graph runs eager). Each size is one log line; a failure is logged, not raised.

    A model that fails its warm-up will fail its clients' requests too, and they say so
    to each of them; the server still starts, to answer ``/health`` and ``/metrics``.
    """
    if isinstance(requests, GenerationRequest):
        requests = [requests]
    for request in requests:
        start = time.perf_counter()
        try:
            await engine.generate(request, request_id=WARM_UP_ID)
            if together > 1:
                async with anyio.create_task_group() as tasks:
                    for index in range(together):
                        tasks.start_soon(
                            functools.partial(
                                engine.generate, request, request_id=f"{WARM_UP_ID}-{index}"
                            )
                        )
        except Exception as exc:
            _log.error("warm-up request failed (%s); serving without it", type(exc).__name__)
            return
        _log.info(
            "warm-up: %d step(s) of %dx%d%s in %.2f s; steps longer than max_step_s are"
            " refused now",
            request.num_steps,
            request.width,
            request.height,
            f", alone and {together} at once" if together > 1 else "",
            time.perf_counter() - start,
        )
    if seal is not None:
        seal()
        _log.info("compiled shapes are sealed: a shape without a graph now runs eager")
