"""Helpers of the parallel tests (tests/parallel/): factories the ranks build, and the
checks a group leaves nothing behind: no rank process, no socket beyond loopback.

The factories are module-level functions (a ``ParallelRunner``'s factory must pickle).
Starting a group costs a model load in each rank (seconds), so the tests share one
group per configuration through ``Kept``, which the engine's ``close`` does not close.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import torch

import omni_trio as ot
from omni_trio.parallel import ParallelRunner, RankReport
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.runners import ModuleGate, request, tiny

__all__ = [
    "ATOL",
    "Kept",
    "abort_inside_a_step",
    "alive",
    "batch_images_of",
    "cached_like_one_rank",
    "calls",
    "children",
    "close",
    "group",
    "guided_requests",
    "hangs_on_flag",
    "images_of",
    "joined_at",
    "listening",
    "loopback",
    "new_children",
    "outputs",
    "raises_in_ranks",
    "report",
    "results",
    "same_states",
    "wait_gone",
]


#: Split and batched classifier-free guidance add in other orders, and so do one rank's
#: attention and the ranks' exchanged one: measured up to ~1e-4 on the decoded images
#: of the tests' 4-step requests.
ATOL = 1e-3


@contextmanager
def group(kind: str, layout: str, **options: Any) -> Iterator[ParallelRunner]:
    """Tiny ``kind`` over two ranks of ``layout`` (``cfg``, ``ulysses`` or ``ring``).

    ``options`` go to ``ParallelRunner`` (the factory too). Closed on exit, torch's
    thread count (which the runner sets) restored.
    """
    threads = torch.get_num_threads()
    options.setdefault("timeout_s", 30.0)
    factory = options.pop("factory", functools.partial(tiny_pipeline, kind))
    degrees = {name: 2 if name == layout else 1 for name in ("cfg", "ulysses", "ring")}
    runner = ParallelRunner(
        factory, cfg=degrees["cfg"], ulysses=degrees["ulysses"], ring=degrees["ring"], **options
    )
    try:
        yield runner
    finally:
        runner.close()
        torch.set_num_threads(threads)


def guided_requests(kind: str) -> list[ot.GenerationRequest]:
    """A request, and one of two images with a negative prompt (Flux takes none)."""
    guided = {} if kind == "flux" else {"negative_prompt": "dull"}
    return [
        request(kind, seed=3, **guided),
        request(kind, seed=4, prompt="a blue boat", num_images=2, **guided),
    ]


def raises_in_ranks(kind: str) -> Any:
    """A factory that builds ``kind`` in the engine's process and raises in every rank's."""
    if multiprocessing.parent_process() is not None:
        raise RuntimeError("this rank cannot load the model")
    return tiny_pipeline(kind)


def hangs_on_flag(kind: str, flag: str) -> Any:
    """``kind``, whose denoiser, in ranks 1..N-1, hangs in every call while ``flag`` exists."""
    pipeline = tiny_pipeline(kind)
    if multiprocessing.parent_process() is not None:
        denoiser = getattr(pipeline, "unet", None) or pipeline.transformer

        def hang(module: torch.nn.Module, args: object) -> None:
            while os.path.exists(flag):
                time.sleep(0.05)

        denoiser.register_forward_pre_hook(hang)
    return pipeline


class Kept:
    """A ``ParallelRunner`` lent to one engine after another: ``close`` leaves it open.

    ``held`` stops the engine's worker before a chosen step, so that a test looks at
    the group at an exact point instead of racing the steps that run on.
    """

    def __init__(self, runner: ParallelRunner) -> None:
        self.runner = runner
        self._when: Callable[[dict[str, int]], bool] | None = None
        self._held = threading.Event()
        self._go = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def step(self, states: Sequence[Any]) -> None:
        """The runner's step, after a hold if this step is the one ``held`` waits for."""
        when = self._when
        if when is not None and when({s.request_id: s.inner.steps_done for s in states}):
            self._when = None
            self._held.set()
            self._go.wait(BUDGET)
        self.runner.step(states)

    @asynccontextmanager
    async def held(self, when: Callable[[dict[str, int]], bool]) -> AsyncIterator[None]:
        """Enter once the worker stops before the first step whose members (request
        id -> steps done) satisfy ``when``; it steps on when the body is left."""
        self._held.clear()
        self._go.clear()
        self._when = when
        try:
            await wait_until(self._held.is_set, max_interval=0.02)
            yield
        finally:
            self._when = None
            self._go.set()

    def close(self) -> None:
        """The engine is done with it; the test module closes it."""


#: The steps of each request ``random_aborts_then_one`` aborts.
ABORTED_STEPS = 40


async def random_aborts_then_one(
    group: ParallelRunner,
    kind: str,
    *,
    aborts: int,
    seed: int,
    pause_s: float,
    images: Sequence[int] = (1,),
) -> None:
    """Abort ``aborts`` requests of ``kind`` at random moments (after 0 to 4 steps and a
    pause of up to ``pause_s``: at a boundary or inside a step), each time checking that
    no rank keeps a state and all agree; then run one more request, whose states are
    bitwise equal on every rank and whose image is the single-process runner's. The
    aborted requests make ``images`` images in turn (a call's rows)."""
    rng = random.Random(seed)
    after = request(kind, seed=99, prompt="after", num_steps=6)
    [expected] = await outputs(DiffusersRunner(tiny(kind)), [after])
    with anyio.fail_after(BUDGET * max(2, aborts // 5)):
        async with ot.open_engine(Kept(group)) as engine:
            for index in range(aborts):
                # ABORTED_STEPS: far more than the at most 4 steps and the pause that pass
                # before the abort, which must find the request running (with 6, a fast
                # machine once finished it in the pause).
                aborted = request(
                    kind,
                    seed=index,
                    num_steps=ABORTED_STEPS,
                    num_images=images[index % len(images)],
                )
                async with engine.submit(aborted, request_id=f"a{index}") as handle:
                    steps, pause = rng.randrange(0, 5), rng.uniform(0.0, pause_s)

                    def reached(h: ot.RequestHandle = handle, n: int = steps) -> bool:
                        return probe(h).steps_done >= n

                    await wait_until(reached)
                    await anyio.sleep(pause)
                    assert await handle.abort()
                reports = await report(group)
                assert same_states(reports) and not reports[0].states, index
            async with engine.submit(after, request_id="after") as handle:
                await wait_until(lambda: probe(handle).steps_done >= 3)
                reports = await report(group)
                assert same_states(reports) and set(reports[0].states) == {"after"}
                got = (await handle.result()).images
    assert close([got], [expected])


class Declaring:
    """A runner that declares ``capabilities`` of another: an engine's workers must agree,
    and a parallel group takes no checkpoints (nor, split by load, a step cache), which a
    ``DiffusersRunner`` beside it would declare."""

    def __init__(self, runner: Any, capabilities: Any) -> None:
        self.runner = runner
        self.capabilities = capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def capabilities_of(kind: str) -> Any:
    """The single-process runner's capabilities for ``kind`` (the runner closed again:
    a live one keeps the cached pipeline's blocks wrapped for its step cache)."""
    runner = DiffusersRunner(tiny(kind))
    try:
        return runner.capabilities
    finally:
        runner.close()


def closed_images_of(kind: str, request: ot.GenerationRequest) -> torch.Tensor:
    """``images_of`` a fresh single-process runner of ``kind``, closed after."""
    runner = DiffusersRunner(tiny(kind))
    try:
        return images_of(runner, request)
    finally:
        runner.close()


def children(pid: int | None = None) -> set[int]:
    """The live processes (zombies included) whose parent is ``pid`` (this process)."""
    parent = str(os.getpid() if pid is None else pid)
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == parent:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: it waits for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: Iterable[int], within: float) -> list[int]:
    """Wait up to ``within`` seconds for ``pids`` to end; return those still running."""
    deadline = time.monotonic() + within
    left = [pid for pid in pids if alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if alive(pid)]
    return left


def _socket_inodes(pids: Iterable[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for name in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(pids: Iterable[int]) -> list[str]:
    """The local addresses (``/proc/net`` hex) of the TCP sockets ``pids`` listen on."""
    inodes = _socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


def loopback(address: str) -> bool:
    """Whether a ``/proc/net/tcp{,6}`` local address is on loopback (127/8 or ::1)."""
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def same_states(reports: Sequence[RankReport]) -> bool:
    """Whether every rank holds the same requests with bitwise equal states."""
    return all(report.states == reports[0].states for report in reports)


async def abort_inside_a_step(
    runner: ParallelRunner, block: torch.nn.Module, first: ot.GenerationRequest
) -> int:
    """Abort ``first`` while rank 0 is inside ``block``'s second call; return the steps
    the engine counted for it (1 when the step was left at a cancel point).

    The gate holds rank 0 in ``block``'s second call until the abort is seen, so the abort
    lands inside that step whatever the timing; the other ranks run on meanwhile.
    """
    gate = ModuleGate(block, 2)
    try:
        async with ot.open_engine(Kept(runner)) as engine:
            handle = engine.submit(first, request_id="held")
            await gate.wait_arrived()

            async def release_once_cut() -> None:
                await wait_until(lambda: probe(handle).cancel_reason is not None)
                gate.release()

            async with anyio.create_task_group() as group:
                group.start_soon(release_once_cut)
                assert await engine.abort("held")
            steps = probe(handle).steps_done
            await handle.aclose()
    finally:
        gate.remove()
    return steps


async def outputs(runner: Any, requests: Sequence[ot.GenerationRequest]) -> list[torch.Tensor]:
    """Every request's images, all submitted at once (so they batch), from a fresh engine."""
    return [output.images for output in await results(runner, requests)]


async def cached_like_one_rank(runner: Any, kind: str) -> None:
    """Cached requests of ``kind`` on a group (a token split) skip where one rank does and
    make its images: a first-block request alone at three thresholds, then beside a
    TaylorSeer one and an uncached one. Every rank ends with no state; the first-block
    requests skipped some calls (the thresholds are within the tiny model's ratios,
    0.2-0.5). At 0.33 the ranks' own halves of tiny Flux's tokens decide differently
    (measured: without the group's sums the ranks' collectives part and the group
    times out)."""
    first = [
        request(kind, seed=3, num_steps=10, cache=ot.StepCache(kind="first-block", threshold=t))
        for t in (0.33, 0.4, 0.46)
    ]
    batch = [
        first[1],
        request(kind, seed=4, prompt="a cat", num_steps=10, cache=ot.StepCache(kind="taylorseer")),
        request(kind, seed=5, prompt="a boat", num_steps=10),
    ]
    for requests in ([first[0]], [first[1]], [first[2]], batch):
        [expected, got] = [
            await results(r, requests) for r in (DiffusersRunner(tiny(kind)), Kept(runner))
        ]
        assert close([g.images for g in got], [e.images for e in expected])
        assert [g.metrics.cache for g in got] == [e.metrics.cache for e in expected]
        skipped = expected[0].metrics.cache
        assert skipped is not None and skipped.calls_skipped > 0
        reports = await report(runner)
        assert same_states(reports) and not reports[0].states


async def results(
    runner: Any, requests: Sequence[ot.GenerationRequest]
) -> list[ot.GenerationOutput]:
    """Every request's output, all submitted at once (so they batch), from a fresh engine."""
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=4)) as engine:
            handles = [engine.submit(r) for r in requests]
            done = []
            for handle in handles:
                async with handle:
                    done.append(await handle.result())
    return done


async def joined_at(
    runner: ParallelRunner,
    first: ot.GenerationRequest,
    second: ot.GenerationRequest,
    *,
    after: int,
    batch: int,
) -> list[ot.GenerationOutput]:
    """``first`` alone until it made ``after`` steps, then ``second`` joins it: the worker
    is held before that step while ``second`` is queued (``Kept.held``); both outputs."""
    with anyio.fail_after(BUDGET):
        kept = Kept(runner)
        async with ot.open_engine(kept, ot.EngineConfig(max_batch_size=batch)) as engine:
            a = engine.submit(first, request_id="first")
            async with kept.held(lambda steps: steps.get("first", 0) >= after):
                b = engine.submit(second, request_id="second")
            done = []
            for handle in (a, b):
                async with handle:
                    done.append(await handle.result())
    return done


def images_of(runner: Any, request: ot.GenerationRequest) -> torch.Tensor:
    """``request``'s images from ``runner`` driven directly (no engine): every step, a decode."""
    [images] = batch_images_of(runner, [request])
    return images


def batch_images_of(runner: Any, requests: Sequence[ot.GenerationRequest]) -> list[torch.Tensor]:
    """Each request's images from ``runner`` driven directly, all of them in every call
    (they share a step count): a batch fixed from the first step to the last, where an
    engine could step the first request before the next one is prepared."""
    [steps] = {r.denoise_steps for r in requests}
    states = []
    try:
        for index, one in enumerate(requests):
            states.append(runner.prepare(one, f"direct-{index}"))
        for _ in range(steps):
            runner.step(states)
        return [runner.decode(state).float().cpu() for state in states]
    finally:
        for state in states:
            runner.discard(state)


async def report(runner: ParallelRunner) -> tuple[RankReport, ...]:
    """Every rank's states, read between two steps (``ParallelRunner.report``)."""
    return await anyio.to_thread.run_sync(runner.report)


async def calls(runner: ParallelRunner) -> dict[str, int]:
    """The model calls each way (``RankReport.calls``), the same on every rank (else the
    group disagrees)."""
    reports = await report(runner)
    assert all(r.calls == reports[0].calls for r in reports), [r.calls for r in reports]
    return dict(reports[0].calls)


def close(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    """Whether each image equals its expected one within ``ATOL``."""
    return all(torch.allclose(g, e, atol=ATOL, rtol=0) for g, e in zip(got, expected, strict=True))


def _is_resource_tracker(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in command


def new_children(before: set[int]) -> set[int]:
    """This process's children that were not in ``before``, but multiprocessing's resource
    tracker (started with the first spawn, it serves the whole process and ends with it)."""
    return {pid for pid in children() - before if not _is_resource_tracker(pid)}
