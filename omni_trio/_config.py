"""Engine configuration, validated at construction.

Every field is checked when the dataclass is built (``ValueError`` naming the
field, for any value: an integer too large for a float or for a container's size
is refused like a negative one). ``check_request`` applies the engine's limits to
a request at ``submit``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from ._errors import InvalidRequestError
from ._results import ResultCache
from ._stepcache import StepCache
from ._validate import (
    check_float,
    check_int,
    check_tenant,
    check_tenant_weight,
    fail_config,
    fail_request,
)

if TYPE_CHECKING:
    from ._request import GenerationRequest
    from ._runner import RunnerCapabilities

__all__ = ["EngineConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How an engine schedules, buffers, bounds and shuts down.

    Args:
        max_batch_size: most requests run together in one denoise step (the
            runner's own limit applies too).
        max_waiting: most requests waiting for the worker; ``submit`` raises
            ``QueueFullError`` beyond it.
        event_buffer: step events kept per request for a slow consumer; newer
            events replace older ones.
        shutdown_grace: seconds running requests get to finish when the engine
            closes; 0 stops them at the next step boundary.
        stop_timeout_s: seconds the engine waits for its workers, once shutdown
            cut the running requests (after the grace), before it logs at ERROR
            each worker that has not exited, with the requests it holds (L37). It
            keeps waiting: a thread cannot be killed, and ``aclose`` returns only
            once they exited (L35). The default, 10 s, is far longer than a step
            with cancel points takes to stop (a block), and shorter than what a
            service manager waits before it kills a process (systemd: 90 s).
        max_steps: largest ``num_steps`` accepted.
        max_height: largest ``height`` accepted, in pixels.
        max_width: largest ``width`` accepted, in pixels.
        max_num_images: largest ``num_images`` accepted.
        max_frame_pixels: most frame pixels of a video request, ``num_images x
            num_frames x height x width`` (L4): what its decode hands over, 12 bytes
            each (float32 RGB). The default, 2**27 (134,217,728), is 1.5 GiB of
            frames: 121 frames at 1024 x 1024, or 129 at 1280 x 720 (Wan's 720p)
            times one video; a few GB of memory with the MP4 written from it, on a
            CPU box. It counts every video of the request because one decode makes
            them all (the chunks of a chunked decode land in one output). Without
            it the other limits admit 4,320 frames at 2048 x 2048: 217 GB.
        max_prompt_chars: longest prompt (and negative prompt) accepted.
        max_step_s: the longest one denoise step of a request alone may take, by
            the worker's measured cost per pixel (a moving average of its batch
            steps' seconds over ``num_images x height x width x max(1,
            num_frames)``): a request whose own step would take longer is refused
            at ``submit`` naming its size (L4); before a step is measured, it
            admits. An abort, a deadline and shutdown land at a step boundary or
            a cancel point, so this bounds how long one request can hold a
            worker past them. The default, 30 s, is what an orchestrator waits
            for a process to stop (Kubernetes' default grace period): a longer
            step could not be stopped before the process is killed. ``None``: no
            bound.
        preemption: whether a waiting request of strictly higher priority (or,
            with ``tenant_preemption``, of another tenant over its share) may
            suspend a running one at a step boundary when it cannot start
            otherwise (L61; only with a runner that declares ``suspendable``).
        max_preemptions: most times one request is suspended; after that it runs
            to its end whatever arrives, so a stream of urgent requests cannot
            keep a long one from finishing.
        park_on_host: suspended requests keep their state in host memory instead
            of on the device (the runner moves it both ways).
        max_parked_bytes: most bytes of suspended state the worker holds at once
            (the runner's ``state_bytes``); a preemption that would exceed it does
            not happen. ``None``: no bound.
        torch_threads: torch's intra-op thread count for the process (it is
            process-wide, one setting for every worker); ``None``: with several
            workers, the CPU cores divided among them, with one, left as it is.
        default_cache: the step-cache policy (L80) of a request that gives none
            (``GenerationRequest.cache`` is ``None``); ``None``: no caching. A
            request opts out with ``StepCache(kind="none")``. ``open_engine``
            refuses one its runners cannot apply.
        tenant_weights: each named tenant's weight in fair share (L57, L58):
            within a priority level, backlogged tenants get device step-seconds
            in proportion to their weights. A tenant not named here (and the
            default tenant, ``None``) weighs 1. Weights are numbers from
            ``MIN_TENANT_WEIGHT`` to ``MAX_TENANT_WEIGHT`` (0.001 to 1000: beyond,
            fair share's float64 clock rounds costs away); names as
            ``GenerationRequest.tenant``'s. Stored as a read-only copy.
        tenant_max_waiting: the most requests a named tenant may have waiting
            (suspended ones included); ``submit`` raises ``QueueFullError`` beyond
            it (L56). A tenant not named here is bounded by ``max_waiting`` only.
        tenant_preemption: with ``preemption``, whether a waiting request may
            suspend a running one of its own priority and another tenant, when
            the batch is full and that tenant holds more places in it than its
            weight's share (L61 amended, L57): a light tenant's request then
            starts at the next boundary beside a heavy tenant's full batch,
            instead of waiting for a place to free. The places are counted over
            the worker's last 1,024 full batch steps and the batch now, so a
            tenant that ran little lately may hold more than its share for a
            while. Requests of one tenant (and of the default tenant alone) never
            preempt each other.
        result_cache: keep the outputs of seeded requests and answer exact repeats
            from them at ``submit``, without a worker (``ResultCache``: its bound, its
            folder, its scope; L95, L96); ``None`` (the default): off. The runners must
            name their model (``result_fingerprint()``): ``open_engine`` refuses them
            otherwise.
    """

    max_batch_size: int = 4
    max_waiting: int = 1024
    event_buffer: int = 16
    shutdown_grace: float = 0.0
    max_steps: int = 1000
    max_height: int = 2048
    max_width: int = 2048
    max_num_images: int = 16
    max_frame_pixels: int = 2**27
    max_prompt_chars: int = 16_384
    max_step_s: float | None = 30.0
    stop_timeout_s: float = 10.0
    preemption: bool = True
    max_preemptions: int = 2
    park_on_host: bool = False
    max_parked_bytes: int | None = None
    torch_threads: int | None = None
    default_cache: StepCache | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    tenant_max_waiting: Mapping[str, int] = field(default_factory=dict)
    tenant_preemption: bool = True
    result_cache: ResultCache | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_waiting",
            "event_buffer",
            "max_steps",
            "max_height",
            "max_width",
            "max_num_images",
            "max_frame_pixels",
            "max_prompt_chars",
        ):
            # sys.maxsize: the sizes bound buffers and queues, which are C-sized.
            value = check_int(
                fail_config, name, getattr(self, name), minimum=1, maximum=sys.maxsize
            )
            object.__setattr__(self, name, value)
        for name in ("preemption", "park_on_host", "tenant_preemption"):
            if not isinstance(getattr(self, name), bool):
                fail_config(name, f"must be a bool, got {type(getattr(self, name)).__name__}")
        preemptions = check_int(
            fail_config, "max_preemptions", self.max_preemptions, minimum=0, maximum=sys.maxsize
        )
        object.__setattr__(self, "max_preemptions", preemptions)
        if self.max_parked_bytes is not None:
            parked = check_int(
                fail_config,
                "max_parked_bytes",
                self.max_parked_bytes,
                minimum=0,
                maximum=sys.maxsize,
            )
            object.__setattr__(self, "max_parked_bytes", parked)
        if self.torch_threads is not None:
            threads = check_int(
                fail_config, "torch_threads", self.torch_threads, minimum=1, maximum=4096
            )
            object.__setattr__(self, "torch_threads", threads)
        grace = check_float(fail_config, "shutdown_grace", self.shutdown_grace, minimum=0.0)
        object.__setattr__(self, "shutdown_grace", grace)
        if self.result_cache is not None and not isinstance(self.result_cache, ResultCache):
            kind = type(self.result_cache).__name__
            fail_config("result_cache", f"must be a ResultCache or None, got {kind}")
        if self.default_cache is not None and not isinstance(self.default_cache, StepCache):
            kind = type(self.default_cache).__name__
            fail_config("default_cache", f"must be a StepCache or None, got {kind}")
        stop = check_float(fail_config, "stop_timeout_s", self.stop_timeout_s, minimum=0.0)
        object.__setattr__(self, "stop_timeout_s", stop)
        if self.max_step_s is not None:
            step = check_float(fail_config, "max_step_s", self.max_step_s, minimum=0.0)
            if step == 0.0:
                fail_config("max_step_s", "must be > 0 (None: no bound), got 0.0")
            object.__setattr__(self, "max_step_s", step)
        weights = _tenant_table(
            "tenant_weights",
            self.tenant_weights,
            lambda name, value: check_tenant_weight(fail_config, name, value),
        )
        object.__setattr__(self, "tenant_weights", weights)
        limits = _tenant_table(
            "tenant_max_waiting",
            self.tenant_max_waiting,
            lambda name, value: check_int(fail_config, name, value, minimum=1, maximum=sys.maxsize),
        )
        object.__setattr__(self, "tenant_max_waiting", limits)

    def check_request(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequestError`` naming the first field over this config's limits."""
        for name, limit in (
            ("num_steps", self.max_steps),
            ("height", self.max_height),
            ("width", self.max_width),
            ("num_images", self.max_num_images),
        ):
            value: int = getattr(request, name)
            if value > limit:
                fail_request(name, f"must be <= {limit} (engine limit), got {value}")
        for name in ("prompt", "negative_prompt"):
            text: str | None = getattr(request, name)
            if text is not None and len(text) > self.max_prompt_chars:
                fail_request(name, f"longer than {self.max_prompt_chars} characters")
        frames = request.num_frames
        if frames is not None:
            pixels = request.num_images * frames * request.height * request.width
            if pixels > self.max_frame_pixels:
                fail_request(
                    "num_frames",
                    f"num_images x num_frames x height x width = {request.num_images} x"
                    f" {frames} x {request.height} x {request.width} = {pixels:,} frame"
                    f" pixels, over the engine's max_frame_pixels of"
                    f" {self.max_frame_pixels:,}",
                )

    def check_default_cache(self, capabilities: RunnerCapabilities) -> None:
        """Refuse a ``default_cache`` the runners cannot apply, before any request (L80)."""
        if self.default_cache is None:
            return
        try:
            capabilities.check_cache(self.default_cache.kind)
        except InvalidRequestError as exc:
            raise ValueError(f"default_{exc}") from None  # "default_cache: this runner ..."

    def with_default_cache(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` as admitted: with ``default_cache`` when it gives no policy (L80)."""
        if request.cache is not None or self.default_cache is None:
            return request
        return dataclasses.replace(request, cache=self.default_cache)


V = TypeVar("V")


def _tenant_table(name: str, table: object, check: Callable[[str, object], V]) -> Mapping[str, V]:
    """A read-only copy of a mapping of tenant names (``check_tenant``) to values."""
    if not isinstance(table, Mapping):
        fail_config(name, f"must be a mapping of tenant names, got {type(table).__name__}")
    copy: dict[str, V] = {}
    for tenant, value in list(table.items()):
        if not isinstance(tenant, str):
            fail_config(name, f"tenant names must be str, got {type(tenant).__name__}")
        tenant = check_tenant(fail_config, name, tenant, what="a tenant name")
        copy[tenant] = check(f"{name}[{tenant!r}]", value)
    return FrozenMapping(copy)


K = TypeVar("K")


class FrozenMapping(Mapping[K, V]):
    """A read-only copy of a mapping that hashes, compares and pickles as its items do.

    Not ``MappingProxyType``: a config travels to other processes (a Ray replica's
    options are pickled) and is hashable.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[K, V]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._items[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple[type[FrozenMapping[K, V]], tuple[dict[K, V]]]:
        return type(self), (self._items,)
