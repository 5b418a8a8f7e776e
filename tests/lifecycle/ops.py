"""The operations a lifecycle plan is made of, and the Hypothesis strategies for plans.

A plan is an engine configuration, a list of operations and a way to end; the
model (``model.Machine``) applies each operation to a live engine. To add an
operation: a frozen dataclass here, a weighted strategy in ``WEIGHTED``, a
``case`` in ``Machine.apply``, and the expectations it adds to the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hypothesis import strategies as st

#: Plans reuse the ids r0, r1 and r2; ABSENT_ID is never submitted.
SLOTS = 3
ABSENT_ID = "r9"
#: Operations on a request pick one of those there are, by index modulo their
#: number; aborts use the last two picks for a finished and an unknown id.
PICKS = 8
MAX_STEPS = 6
MAX_SIZE = 16
#: Fair share's price of a pixel-step (``assume_step_cost``): a request's cost is
#: its steps times 1 (8 x 8) or 4 (16 x 16), whatever the steps measured (L57).
PIXEL_S = 1 / 64
#: Deadlines are whole multiples of this many seconds of virtual time, and the
#: clock jumps by whole multiples of it (see ``clock``): so whether a deadline has
#: passed depends on the plan alone, never on the real time an operation took (a
#: plan takes seconds), and the engine's estimate (measured step time, gate waits
#: included, times at most some 60 steps) never refuses one.
DEADLINE_UNIT = 10_000.0
#: A deadline no estimate can meet: refused once a step was measured, unless the
#: engine would start the request at the next boundary (L62).
TIGHT_DEADLINE = 1e-9
#: The priority of a request with ``TIGHT_DEADLINE``: below every other a plan
#: submits, so it is ranked behind everything waiting and preempts nothing.
TIGHT_PRIORITY = -3

Invalid = Literal["steps", "multiple", "width", "extra", "type", "empty_id"]
INVALID_FIELD: dict[str, str] = {
    "steps": "num_steps",
    "multiple": "height",
    "width": "width",
    "extra": "extra",
    "type": "request",
    "empty_id": "request_id",
}


@dataclass(frozen=True)
class Submit:
    slot: int | None  # None: a fresh id
    steps: int
    size: int
    seed: int
    preview_every: int
    read: bool
    invalid: Invalid | None
    # In DEADLINE_UNITs; "tight": TIGHT_DEADLINE (sent only once a step was measured).
    deadline: int | Literal["tight"] | None = None
    # A higher one than a running request's may suspend it (L61).
    priority: int = 0
    # Raise the priority above every running request's: preemption's premise.
    urgent: bool = False
    # Whose request it is (L57): fair share between tenants at each priority.
    tenant: str | None = None


@dataclass(frozen=True)
class Advance:
    units: int  # jump the clock this many DEADLINE_UNITs forward


@dataclass(frozen=True)
class Release:
    n: int
    worker: int = 0  # whose runner, modulo the number of workers


@dataclass(frozen=True)
class OpenGate:
    pass


@dataclass(frozen=True)
class Abort:
    pick: int  # which live request (see Machine.target); PICKS - 1: an unknown id
    how: Literal["nowait", "await", "handle"]
    reason: Literal["user", "client"]
    suspended: bool = False  # a suspended request's id, if there is one (L61)


@dataclass(frozen=True)
class Leave:
    pick: int  # which open handle
    how: Literal["aclose", "exit", "exception", "cancel"]
    suspended: bool = False  # a suspended request's, if there is one (L61)


@dataclass(frozen=True)
class CancelCaller:
    pick: int
    target: Literal["result", "generate"]


@dataclass(frozen=True)
class Generate:
    steps: int


@dataclass(frozen=True)
class Result:
    pick: int


@dataclass(frozen=True)
class Drop:
    pick: int


@dataclass(frozen=True)
class FailAt:
    step: int | None


@dataclass(frozen=True)
class Kill:
    pass


@dataclass(frozen=True)
class Shutdown:
    background: bool


Op = (
    Submit
    | Release
    | OpenGate
    | Abort
    | Leave
    | CancelCaller
    | Generate
    | Result
    | Drop
    | FailAt
    | Kill
    | Shutdown
    | Advance
)


@dataclass(frozen=True)
class Plan:
    max_batch_size: int
    max_waiting: int
    event_buffer: int
    shutdown_grace: float
    ops: list[Op]
    # How the plan ends: shut down with requests in flight, or drain them first.
    final: Shutdown | None
    # EngineConfig.max_preemptions (0: none, L61) and the number of workers (L42).
    max_preemptions: int = 2
    workers: int = 1
    # EngineConfig.tenant_weights (L57, L58).
    tenant_weights: dict[str, float] = field(default_factory=dict)


slots = st.integers(0, SLOTS - 1)
picks = st.integers(0, PICKS - 1)
#: The default tenant and two named ones (L57).
tenants = st.sampled_from([None, "a", "b"])
submits = st.builds(
    Submit,
    slot=st.one_of(st.none(), slots),
    steps=st.integers(1, MAX_STEPS),
    size=st.sampled_from([8, 16]),
    seed=st.integers(0, 3),
    preview_every=st.sampled_from([0, 0, 1, 2]),
    read=st.booleans(),
    invalid=st.sampled_from([None] * 14 + list(INVALID_FIELD)),
    deadline=st.sampled_from([None, None, 1, 1, 2, 3, "tight"]),
    priority=st.sampled_from([0, 0, 0, -1, 1, 2]),
    urgent=st.sampled_from([False, False, True]),
    tenant=tenants,
)
#: Valid urgent submits under fresh ids: what makes a running request give way (L61).
urgent_submits = st.builds(
    Submit,
    slot=st.none(),
    steps=st.integers(1, MAX_STEPS),
    size=st.sampled_from([8, 16]),
    seed=st.integers(0, 3),
    preview_every=st.sampled_from([0, 1]),
    read=st.booleans(),
    invalid=st.none(),
    deadline=st.sampled_from([None, None, 1, 2]),
    priority=st.sampled_from([0, 1]),
    urgent=st.just(True),
    tenant=tenants,
)
#: How often each operation comes, per hundred (picked by hand, not measured).
WEIGHTED: list[tuple[int, st.SearchStrategy[Op]]] = [
    (27, submits),
    (6, urgent_submits),
    (14, st.builds(Release, n=st.integers(1, 2), worker=st.integers(0, 1))),
    (
        10,
        st.builds(
            Abort,
            pick=picks,
            how=st.sampled_from(["nowait", "await", "handle"]),
            reason=st.sampled_from(["user", "client"]),
            suspended=st.booleans(),
        ),
    ),
    (
        8,
        st.builds(
            Leave,
            pick=picks,
            how=st.sampled_from(["aclose", "exit", "exception", "cancel"]),
            suspended=st.booleans(),
        ),
    ),
    (8, st.builds(Result, pick=picks)),
    (5, st.builds(CancelCaller, pick=picks, target=st.sampled_from(["result", "generate"]))),
    (5, st.builds(Generate, steps=st.integers(1, MAX_STEPS))),
    (3, st.builds(Drop, pick=picks)),
    (4, st.builds(FailAt, step=st.one_of(st.none(), st.integers(1, MAX_STEPS)))),
    (1, st.builds(Shutdown, background=st.booleans())),
    (1, st.just(OpenGate())),
    (1, st.just(Kill())),
    (7, st.builds(Advance, units=st.integers(1, 3))),
]
_KINDS = [index for index, (weight, _) in enumerate(WEIGHTED) for _ in range(weight)]
operations: st.SearchStrategy[Op] = st.sampled_from(_KINDS).flatmap(lambda i: WEIGHTED[i][1])


@st.composite
def floods(draw: st.DrawFn) -> list[Op]:
    """A heavy tenant's two to four submits in a row, then a light one's one or two (L57)."""
    heavy = draw(tenants)
    light = draw(tenants.filter(lambda tenant: tenant != heavy))
    steps = draw(st.integers(1, MAX_STEPS))
    size = draw(st.sampled_from([8, 16]))
    counts = ((heavy, draw(st.integers(2, 4))), (light, draw(st.integers(1, 2))))
    return [
        Submit(None, steps, size, seed, 0, False, None, tenant=tenant)
        for tenant, count in counts
        for seed in range(count)
    ]


#: Runs of operations: mostly one, sometimes a flood (one in twelve, by hand).
runs: st.SearchStrategy[list[Op]] = st.one_of(*[operations.map(lambda op: [op])] * 11, floods())


def plans_for(workers: int) -> st.SearchStrategy[Plan]:
    """Plans for an engine of ``workers`` workers, one ``GatedRunner`` each."""
    return st.builds(
        Plan,
        max_batch_size=st.integers(1, 2),
        max_waiting=st.sampled_from([1, 2, 4, 8]),
        event_buffer=st.integers(1, 4),
        shutdown_grace=st.sampled_from([0.0, 30.0]),
        ops=st.lists(runs, min_size=10, max_size=40).map(
            lambda runs: [op for run in runs for op in run]
        ),
        final=st.one_of(st.none(), st.builds(Shutdown, background=st.booleans())),
        max_preemptions=st.sampled_from([0, 1, 2, 2]),
        workers=st.just(workers),
        tenant_weights=st.sampled_from([{}, {"a": 2.0}, {"a": 0.5, "b": 3.0}]),
    )


plans = plans_for(1)
two_worker_plans = plans_for(2)
