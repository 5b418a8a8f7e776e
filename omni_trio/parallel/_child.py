"""A rank other than 0: build the pipeline, join the group, then run the plans it is sent.

The child's life, each stage told to rank 0 on the control pipe:

1. the parent-death signal (``_processes``), the loopback interface, torch's
   thread count;
2. build: ``factory()``, on its device; ``("built",)`` or ``("error", text)``;
3. wait for ``("go",)`` (rank 0 has built its own pipeline: the rendezvous's
   timeout never counts a model load), join the group, set up context
   parallelism; ``("ready",)``;
4. loop: read a plan, apply its ops, run its step (armed with the agreed check,
   ``_agree``), answer a report or an adapter load; until ``STOP`` or the pipe's
   end of file.

Any failure is sent as ``("error", text)`` (best effort) and ends the process
with exit code 1; rank 0 sees it as the group's death.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["RankSpec", "main"]

#: How many plan delivery times a rank keeps for ``report``.
_SAMPLES = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSpec:
    """Everything a child rank needs, sent to it at spawn.

    Args:
        rank: the child's rank (1..N-1).
        layout: how requests are spread (``_rank.Layout``).
        factory: builds the pipeline (picklable).
        device: the torch device of this rank's pipeline (``None``: where it builds).
        backend: ``"gloo"`` or ``"nccl"``.
        port: the rendezvous's port on 127.0.0.1.
        timeout_s: the collectives' timeout.
        parent: the engine's process id.
        threads: torch's intra-op thread count to start with.
        options: the runner's keyword options (``RankRunner``).
        connection: this child's end of its control pipe.
        flags: the group's shared flags (``_agree``).
    """

    rank: int
    layout: Any
    factory: Callable[[], Any]
    device: str | None
    backend: str
    port: int
    timeout_s: float
    parent: int
    threads: int
    options: dict[str, Any]
    connection: Connection
    flags: Any


def main(spec: RankSpec) -> None:
    """A child rank's whole life (the spawned process's target)."""
    from ._processes import set_parent_death_signal

    set_parent_death_signal(spec.parent)
    connection = spec.connection
    try:
        _run(spec, connection)
    except EOFError:
        # Rank 0 is gone (its end of the pipe closed): nothing to tell anyone.
        return
    except BaseException:
        with suppress(OSError):
            connection.send(("error", traceback.format_exc(limit=20)))
        sys.exit(1)
    finally:
        from ._group import close_group

        close_group()


def _run(spec: RankSpec, connection: Connection) -> None:
    import torch

    from ._group import open_group
    from ._rank import RankRunner, RankStates

    torch.set_num_threads(spec.threads)
    pipeline = spec.factory()
    if spec.device is not None:
        pipeline = pipeline.to(spec.device)
        if torch.device(spec.device).type == "cuda":
            torch.cuda.set_device(torch.device(spec.device))
    layout = spec.layout
    runner = RankRunner(pipeline, layout=layout, rank=spec.rank, **spec.options)
    connection.send(("built",))
    message = connection.recv()
    assert message == ("go",), message
    with ExitStack() as stack:
        open_group(
            rank=spec.rank,
            world=layout.degree,
            port=spec.port,
            listen=None,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
        )
        runner.share_context(stack)
        connection.send(("ready",))
        states = RankStates(runner)
        try:
            _serve(spec, connection, runner, states)
        finally:
            states.discard_all()
            runner.close()


def _serve(spec: RankSpec, connection: Connection, runner: Any, states: Any) -> None:
    import torch

    from .._cancelpoint import armed
    from .._runner import StopRun
    from ._agree import agreed_check
    from ._plan import PlanKind, RankReport, decode_plan

    delivery: deque[float] = deque(maxlen=_SAMPLES)
    agreement = spec.layout.agreement
    while True:
        plan = decode_plan(connection.recv_bytes())
        delivery.append(time.perf_counter() - plan.sent_at)
        states.apply(plan.ops)
        if plan.kind is PlanKind.STOP:
            return
        if plan.kind is PlanKind.REPORT:
            report = RankReport(
                rank=spec.rank,
                states=states.digests(),
                plan_delivery_s=tuple(delivery),
                calls=dict(runner.calls),
                adapters=runner.adapters(),
            )
            connection.send(("report", report))
            continue
        if plan.kind is PlanKind.ADAPTERS:
            connection.send(("adapters", tuple(states.load_failures)))
            states.load_failures.clear()
            continue
        if plan.kind is not PlanKind.STEP:
            continue
        if torch.get_num_threads() != plan.threads:
            torch.set_num_threads(plan.threads)
        members = states.members(plan.members)
        check = agreed_check(agreement, spec.flags, plan.seq, writer=False, engine=None)
        try:
            with armed(check):
                runner.step(members)
        except StopRun:
            # Left at the agreed point, with every rank: rank 0 drops these states.
            pass
        del members
