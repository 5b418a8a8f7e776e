"""Fair share of device time between tenants (L57): virtual time per priority level.

Start-time fair queueing over device step-seconds. At each priority level every
tenant has a tag: the virtual time at which its next request starts, which is
also when its last served request finishes. Serving a request of cost ``c``
(device seconds, see ``StepCosts``) moves its tenant's tag on by ``c / weight``;
the level's virtual time is the tag of the last request served there. The
waiting request with the smallest tag goes first (within its tenant: the
earliest deadline, then the earliest admission; ``_queue``), so each backlogged
tenant gets device time in proportion to its weight, whatever the number or the
size of the requests it sends, and a tenant that floods the queue only moves
its own tag. A tenant that starts waiting again takes ``max(virtual time, its
tag)``: time it spent idle is not saved up for later.

Tags are compared only within a level: priorities rank above fair share (L60). A
level where nothing waits forgets its tags (nobody is backlogged, so nobody is
owed). The state is shared by every queue of an engine (new requests and each
worker's suspended ones), so one tenant's tag is the same wherever its requests
wait. Pure, synchronous: the pool's lock guards it (``_pool``).

Costs: a request is charged once, when a worker takes it from the queue of new
requests, its steps times its step's measured seconds (``StepCosts``): a
suspended request that comes back is not charged again (L61).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType

__all__ = [
    "MAX_TENANT_WEIGHT",
    "MIN_TENANT_WEIGHT",
    "NOMINAL_PIXEL_S",
    "FairShare",
    "StepCosts",
    "Tenant",
]

#: A request's tenant; ``None`` is the default tenant.
Tenant = str | None

# The weights' bounds, from the arithmetic (not measured). Tags and the virtual time
# are float64 sums of ``cost / weight`` over a level's busy period (a level where
# nothing waits starts again from 0). Adding ``d`` to a tag ``T`` rounds the sum to
# within ``T x 2**-53``, so ``d`` keeps a relative error of at most ``(T / d) x
# 2**-53`` and can be lost whole once ``T / d`` passes 2**53 (9e15): the tag stops
# moving, and its tenant's share with it. ``T / d`` is at most ``n x (cost ratio) x
# (w_max / w_min)`` after ``n`` requests, since the lightest tenant moves the clock by
# ``cost / w_min`` per request while the heaviest adds ``cost / w_max``. The first two
# factors are the workload's (a level that never empties grows ``n`` without end,
# whatever the weights); the weights' factor, ``w_max / w_min``, is the part a bound on
# them controls, and as tenants not named weigh 1, the range is centred on 1. At
# [1e-3, 1e3] it is 1e6 (20 of the 53 bits): costs still count to 1e-3 relative while
# ``n x (cost ratio)`` stays under 9e6 (9,000 requests at a thousand times the others'
# cost, served to the lightest tenant alone), and none is lost before 9e9. A weight of
# 1e-20 spent all 53 bits: by its tenant's second request the clock stood at 1e20
# times the cost, and every weight-1 tenant's cost after it rounded to nothing. A
# contrast of a thousand either way is more than fair share between customers needs.

#: The smallest tenant weight accepted (see the bounds' reasoning above).
MIN_TENANT_WEIGHT = 1e-3

#: The largest tenant weight accepted (see the bounds' reasoning above).
MAX_TENANT_WEIGHT = 1e3

#: The cost of a step per pixel before any step was measured: only relative sizes
#: matter then (1 ns, picked without measurement; a measured figure replaces it).
NOMINAL_PIXEL_S = 1e-9

#: The weight of the newest measurement in the moving averages (as the worker's).
_WEIGHT = 0.2


class _Level:
    """One priority level's virtual time, tenant tags and waiting counts."""

    __slots__ = ("counts", "tags", "virtual")

    def __init__(self) -> None:
        self.virtual = 0.0
        # The tag of every tenant that waits here, and of idle ones whose tag is
        # ahead of the virtual time (they would restart there).
        self.tags: dict[Tenant, float] = {}
        self.counts: dict[Tenant, int] = {}


class FairShare:
    """Tenant weights and, per priority level, the tenants' tags (see the module)."""

    __slots__ = ("_levels", "_sweep_at", "_waiting", "_weights")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights: Mapping[str, float] = MappingProxyType(dict(weights or {}))
        self._levels: dict[int, _Level] = {}
        # Waiting items per tenant, over every level and queue (per-tenant limits).
        self._waiting: dict[Tenant, int] = {}
        self._sweep_at = 16

    def weight(self, tenant: Tenant) -> float:
        """The tenant's weight: its configured one, else 1."""
        return 1.0 if tenant is None else self._weights.get(tenant, 1.0)

    def waiting(self, tenant: Tenant) -> int:
        """How many of the tenant's requests wait, in every queue."""
        return self._waiting.get(tenant, 0)

    def tag(self, priority: int, tenant: Tenant) -> float:
        """The tenant's tag at ``priority``; only while one of its requests waits there."""
        return self._levels[priority].tags[tenant]

    def joined(self, priority: int, tenant: Tenant) -> None:
        """One of the tenant's requests waits at ``priority`` now (in any queue)."""
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = _Level()
        count = level.counts.get(tenant, 0)
        if not count:
            level.tags[tenant] = max(level.virtual, level.tags.get(tenant, level.virtual))
        level.counts[tenant] = count + 1
        self._waiting[tenant] = self._waiting.get(tenant, 0) + 1

    def left(self, priority: int, tenant: Tenant, *, cost: float | None = None) -> None:
        """One of the tenant's requests left the queues at ``priority``.

        With ``cost`` it was served (taken by a worker): the level's virtual time
        moves to the tenant's tag, and the tag on by ``cost / weight``. Without,
        it was withdrawn (aborted, expired, shut down) and nothing is charged. A
        cost of 0 (a suspended request taken again, charged when first taken)
        moves nothing either: its start was its first take's, not the tag its
        tenant's later requests start from.
        """
        level = self._levels[priority]
        if cost:
            start = level.tags[tenant]
            level.virtual = max(level.virtual, start)
            level.tags[tenant] = start + cost / self.weight(tenant)
        waiting = self._waiting[tenant] - 1
        if waiting:
            self._waiting[tenant] = waiting
        else:
            del self._waiting[tenant]
        count = level.counts[tenant] - 1
        if count:
            level.counts[tenant] = count
            return
        del level.counts[tenant]
        if not level.counts:
            del self._levels[priority]  # nobody waits here: nobody is owed
        elif level.tags[tenant] <= level.virtual:
            del level.tags[tenant]  # it would restart at the virtual time anyway
        elif len(level.tags) > self._sweep_at:
            self._sweep(level)

    def _sweep(self, level: _Level) -> None:
        """Forget the idle tenants the virtual time has passed: O(tags), amortised O(1)."""
        for tenant in [t for t, tag in level.tags.items() if tag <= level.virtual]:
            if tenant not in level.counts:
                del level.tags[tenant]
        self._sweep_at = max(16, 2 * len(level.tags))

    def clear(self) -> None:
        """Forget every level (every queue was drained)."""
        self._levels.clear()
        self._waiting.clear()


class StepCosts:
    """What one step of a request costs on a device, in seconds, by its batch key.

    Per batch key, a moving average of the measured cost per pixel (a batch step's
    seconds over its members' ``step_pixels``); a request's step costs that times
    its own pixels (so a request's cost scales with its size, and a key whose
    steps cost more per pixel, such as a long video's attention, costs what it
    measured). A key not measured yet takes the average over every key; before
    any step, ``NOMINAL_PIXEL_S``.

    Written by the workers' threads after each step, read by admission under the
    pool's lock: each update stores one float per key (atomic); two workers
    measuring one key at once may lose one of the two updates, which only delays
    the average by a step.
    """

    __slots__ = ("_by_key", "_overall", "_pinned")

    def __init__(self) -> None:
        self._by_key: dict[Hashable, float] = {}
        self._overall: float | None = None
        self._pinned: float | None = None

    def measured(self, key: Hashable, seconds: float, pixels: int) -> None:
        """Fold one batch step of ``key``: ``seconds`` over ``pixels`` in all."""
        if self._pinned is not None:
            return
        pixel_s = seconds / max(1, pixels)
        old = self._by_key.get(key)
        self._by_key[key] = pixel_s if old is None else old + _WEIGHT * (pixel_s - old)
        overall = self._overall
        self._overall = pixel_s if overall is None else overall + _WEIGHT * (pixel_s - overall)

    def step_s(self, key: Hashable, pixels: int) -> float:
        """The estimated device seconds of one step of ``pixels`` with batch ``key``."""
        pixel_s = self._pinned
        if pixel_s is None:
            pixel_s = self._by_key.get(key, self._overall)
        return (NOMINAL_PIXEL_S if pixel_s is None else pixel_s) * pixels

    def pin(self, pixel_s: float | None) -> None:
        """Use ``pixel_s`` for every key and ignore measurements (``None``: measure again).

        For tests and simulations (``omni_trio.testing.assume_step_cost``): costs,
        and so the order fair share picks, then depend on the requests alone.
        """
        self._pinned = pixel_s
