"""A group's start and its end: the runner's arguments checked, ranks 1..N-1 spawned,
rank 0 built, every rank joined (L49); every rank reaped again (L41).

``start_group`` is ``ParallelRunner``'s constructor's work below the runner: it
spawns the ranks (``_processes``), builds rank 0's pipeline while they build theirs,
then, once every rank is built, opens the torch.distributed group (``_group``: the
rendezvous's timeout never counts a model load) and sets up the layout's context
parallelism on every rank. A rank that fails, ends or is late fails the start
(``ParallelStartError``) and nothing stays: the ranks reaped, the pipes and the
group closed, rank 0's runner closed. ``StartedGroup.release`` is the same undoing
for a started group (``ParallelRunner.close``), and ``failure_reasons`` says what
the other ranks said or did when the group breaks.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from ..runners import context_parallel_denoisers
from ._agree import Flags, new_flags
from ._child import RankSpec, main
from ._group import close_group, group_in_use, listening_socket, open_group
from ._processes import RankProcesses
from ._rank import Layout, RankRunner

__all__ = [
    "KEEPER",
    "ParallelStartError",
    "StartedGroup",
    "failure_reasons",
    "layout_of",
    "start_group",
]

#: The rank processes' names, and their keeper thread's (``<KEEPER>-keeper``): not an
#: engine thread's name (the runner starts it, and its ``close`` joins it).
KEEPER = "parallel-ranks"
#: Seconds a failure waits for a peer's exit, to say why it failed.
_FAILURE_WAIT_S = 0.5


class ParallelStartError(Exception):
    """The ranks did not start: a factory raised, a rank died, or the start timed out."""


def layout_of(cfg: int, ulysses: int, ring: int, by_load: bool) -> Layout:
    """The layout the runner's degrees name.

    Raises:
        ValueError: not exactly one degree above 1, a degree that is not an int >= 1,
            or ``by_load`` with the guidance split.
    """
    degrees = {"cfg": cfg, "ulysses": ulysses, "ring": ring}
    for name, degree in degrees.items():
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"{name}: must be an int >= 1, got {degree!r}")
    split = [name for name, degree in degrees.items() if degree > 1]
    if len(split) != 1:
        raise ValueError(
            "give exactly one of cfg, ulysses or ring above 1 (they do not combine yet);"
            f" got {degrees}"
        )
    kind = split[0]
    if not isinstance(by_load, bool):
        raise ValueError(f"by_load: must be a bool, got {by_load!r}")
    if by_load and kind == "cfg":
        raise ValueError(
            "by_load: only with ulysses or ring (the split already cuts every call by rows)"
        )
    return Layout(kind=kind, degree=degrees[kind], by_load=by_load)  # type: ignore[arg-type]


def _devices(devices: Sequence[str] | None, degree: int) -> list[str | None]:
    if devices is None:
        return [None] * degree
    names = list(devices)
    if len(names) != degree:
        raise ValueError(f"devices: give one per rank ({degree}), got {len(names)}")
    kinds = {torch.device(name).type for name in names}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"devices: all CPU or all CUDA, got {names}")
    if "cuda" in kinds and len(set(names)) != len(names):
        raise ValueError(f"devices: a GPU named twice in {names}")
    return list(names)


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


@dataclass(frozen=True, slots=True, kw_only=True)
class StartedGroup:
    """What rank 0 holds of a group besides its runner: the other ranks' processes and
    control pipes (rank 1 first), the agreed cancel points' flags (``_agree``), and
    what the start set up in this process (``stack``: ring attention's wrapper)."""

    ranks: RankProcesses
    connections: tuple[Connection, ...]
    flags: Flags
    stack: ExitStack

    def release(self, *, grace: float) -> None:
        """End ranks 1..N-1 (``grace`` seconds to exit, then SIGKILL), close the pipes,
        the group and what the start set up; idempotent."""
        self.ranks.reap(grace=grace)
        for connection in self.connections:
            connection.close()
        close_group()
        self.stack.close()


def start_group(
    factory: Callable[[], Any],
    layout: Layout,
    *,
    devices: Sequence[str] | None,
    timeout_s: float,
    start_timeout_s: float,
    torch_threads: int | None,
    options: dict[str, Any],
) -> tuple[StartedGroup, RankRunner]:
    """Start a group of ``layout`` (``ParallelRunner``'s arguments, checked here); the
    group, and rank 0's runner, whose context parallelism is on.

    Sets torch's thread count in this process (every rank follows it).

    Raises:
        ValueError: bad devices or timeouts, or heads (Ulysses) that do not divide by
            the ranks.
        TypeError: the factory does not pickle.
        ParallelStartError: a rank did not start, or this process has a group already.
    """
    names = _devices(devices, layout.degree)
    if not (timeout_s > 0 and start_timeout_s > 0):
        raise ValueError("timeout_s, start_timeout_s: must be > 0")
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            f"factory: must pickle, to reach the ranks (a module-level function or a"
            f" functools.partial of one): {exc}"
        ) from None
    if group_in_use():
        raise ParallelStartError(
            "torch.distributed's default group is in use: one ParallelRunner per process"
        )
    threads = torch_threads if torch_threads is not None else max(1, _cores() // layout.degree)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    backend = "nccl" if names[0] is not None and torch.device(names[0]).type == "cuda" else "gloo"
    context = multiprocessing.get_context("spawn")
    flags = new_flags(context)
    listen = listening_socket()
    pipes = [context.Pipe() for _ in range(layout.degree - 1)]
    specs = [
        RankSpec(
            rank=rank,
            layout=layout,
            factory=factory,
            device=names[rank],
            backend=backend,
            port=listen.getsockname()[1],
            timeout_s=timeout_s,
            parent=os.getpid(),
            threads=threads,
            options=options,
            connection=theirs,
            flags=flags,
        )
        for rank, (_, theirs) in enumerate(pipes, start=1)
    ]
    group = StartedGroup(
        ranks=RankProcesses(context, main, [(spec,) for spec in specs], name=KEEPER),
        connections=tuple(ours for ours, _ in pipes),
        flags=flags,
        stack=ExitStack(),
    )
    runner: RankRunner | None = None
    try:
        try:
            group.ranks.start()
        finally:
            for _, theirs in pipes:
                theirs.close()  # the child's end is the child's: its exit is our EOF
        runner = _build(factory, names[0], layout, options)
        _await(group, "built", start_timeout_s)
        for connection in group.connections:
            connection.send(("go",))
        open_group(
            rank=0,
            world=layout.degree,
            port=listen.getsockname()[1],
            listen=listen,
            backend=backend,
            timeout_s=timeout_s,
        )
        runner.share_context(group.stack)
        _await(group, "ready", timeout_s)
    except BaseException:
        listen.close()
        group.release(grace=0)
        if runner is not None:
            runner.close()
        raise
    return group, runner


def _build(
    factory: Callable[[], Any], device: str | None, layout: Layout, options: dict[str, Any]
) -> RankRunner:
    """Rank 0's pipeline and runner, checked against the layout."""
    try:
        pipeline = factory()
        if device is not None:
            pipeline = pipeline.to(device)
    except Exception as exc:
        raise ParallelStartError(f"rank 0: the factory raised {type(exc).__name__}: {exc}") from exc
    if layout.kind != "cfg":
        for model in context_parallel_denoisers(pipeline, layout.kind):
            heads = int(getattr(model.config, "num_attention_heads", 0))
            if layout.kind == "ulysses" and heads % layout.degree:
                raise ValueError(
                    f"ulysses: {heads} attention heads do not divide by {layout.degree} ranks"
                )
    return RankRunner(pipeline, layout=layout, rank=0, **options)


def _await(group: StartedGroup, stage: str, timeout: float) -> None:
    """Wait for every rank to say ``stage``; fail at once when one fails or ends.

    Raises:
        ParallelStartError: a rank failed, ended, or was late.
    """
    deadline = time.monotonic() + timeout
    waiting = dict(enumerate(group.connections, start=1))
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ParallelStartError(
                f"ranks {sorted(waiting)} were not {stage} within {timeout:g} s"
            )
        ready = wait(list(waiting.values()), left)
        for rank, connection in list(waiting.items()):
            if connection not in ready:
                continue
            try:
                message = connection.recv()
            except EOFError:
                group.ranks.wait_exit(_FAILURE_WAIT_S)
                code = group.ranks.exit_codes()[rank - 1]
                raise ParallelStartError(
                    f"rank {rank} ended while starting ({_exit_text(code)})"
                ) from None
            if message[0] == "error":
                raise ParallelStartError(f"rank {rank} failed to start:\n{message[1]}")
            if message == (stage,):
                del waiting[rank]


def failure_reasons(group: StartedGroup) -> str:
    """What each other rank said or did before a failure (its error, its exit), each
    after ``"; "``: waits a moment for a peer's exit first."""
    group.ranks.wait_exit(_FAILURE_WAIT_S)
    reasons = []
    codes = group.ranks.exit_codes()
    for rank, connection in enumerate(group.connections, start=1):
        said = ""
        try:
            while connection.poll(0):
                message = connection.recv()
                if isinstance(message, tuple) and message[0] == "error":
                    said = str(message[1]).strip().splitlines()[-1]
        except (EOFError, OSError):
            pass
        code = codes[rank - 1]
        if code is not None or said:
            reasons.append(f"; rank {rank} {_exit_text(code)}" + (f": {said}" if said else ""))
    return "".join(reasons)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"
