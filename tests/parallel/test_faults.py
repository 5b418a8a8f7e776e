"""Faults of a parallel group (L41, L43, L49): a rank killed, a rank hung in a collective,
a start that fails, the engine's process killed, a load on a group whose rank died.
Each case starts its own group.

Determinism: where a rank is killed is drawn from a seeded generator (a step event,
then a pause); the hang is a hook in the other rank's denoiser that waits while a
file exists (created before the request); every check is exact: the error each
request gets, the processes left (``/proc``), the sockets listening. The collective
timeout is what bounds the hang; nothing here measures time.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

import omni_trio as ot
from omni_trio.parallel import ParallelGroupError, ParallelStartError
from omni_trio.runners import DiffusersRunner, tiny_lora
from omni_trio.serve import ServeConfig, Service
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.parallel import (
    Declaring,
    alive,
    children,
    group,
    hangs_on_flag,
    listening,
    new_children,
    raises_in_ranks,
    wait_gone,
)
from tests.support.runners import request, tiny
from tests.support.serve import serving

ROOT = Path(__file__).resolve().parents[2]


def nothing_left(before_children: set[int], before_listening: set[str], ranks: set[int]) -> None:
    """No rank process, no new child (not even a zombie), no new listening socket."""
    assert not ranks & children()
    assert not new_children(before_children)
    assert set(listening([os.getpid()])) <= before_listening


@pytest.mark.anyio
async def test_a_rank_killed_at_a_random_moment_fails_the_engine_and_leaves_no_process() -> None:
    """L41: a rank killed (SIGKILL) while a request runs: the request fails with
    ``EngineDeadError`` (the group's error, naming the rank and its signal, as the
    cause), leaving ``open_engine`` raises it, and every rank process is reaped."""
    rng = random.Random(41)
    before, before_listening = children(), set(listening([os.getpid()]))
    with group("sd", "cfg", timeout_s=10.0) as runner:
        ranks = set(runner.pids)
        with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError) as dead:
            async with ot.open_engine(runner) as engine:
                async with engine.submit(request("sd", num_steps=200)) as handle:
                    await wait_until(lambda: probe(handle).steps_done >= rng.randrange(1, 4))
                    await anyio.sleep(rng.uniform(0.0, 0.03))
                    os.kill(runner.pids[0], signal.SIGKILL)
                    with pytest.raises(ot.EngineDeadError) as failed:
                        await handle.result()
        assert isinstance(dead.value.__cause__, ParallelGroupError)
        assert "rank 1 was killed by signal 9" in str(failed.value)
    nothing_left(before, before_listening, ranks)


@pytest.mark.anyio
async def test_a_hung_rank_fails_its_group_within_the_timeout_and_the_other_worker_serves_on(
    tmp_path: Path,
) -> None:
    """L41, L43: a rank that hangs inside its forward leaves rank 0 in the step's
    all-gather until the collective timeout: the group's worker dies with the group,
    its request fails with ``RequestFailedError``, the engine's other worker serves on,
    and the hung rank is killed and reaped."""
    flag = tmp_path / "hang"
    flag.touch()
    factory = functools.partial(hangs_on_flag, "sd", str(flag))
    before, before_listening = children(), set(listening([os.getpid()]))
    with group("sd", "cfg", factory=factory, timeout_s=3.0) as runner:
        ranks = set(runner.pids)
        with anyio.fail_after(BUDGET):
            beside = Declaring(DiffusersRunner(tiny("sd")), runner.capabilities)
            workers: list[Any] = [runner, beside]
            async with ot.open_engine(workers) as engine:
                handles = [engine.submit(request("sd", seed=seed)) for seed in (1, 2)]
                await wait_until(lambda: all(probe(h).worker is not None for h in handles))
                on_group = next(h for h in handles if probe(h).worker == 0)
                elsewhere = next(h for h in handles if probe(h).worker == 1)
                async with on_group:
                    with pytest.raises(ot.RequestFailedError) as failed:
                        await on_group.result()
                async with elsewhere:
                    await elsewhere.result()
                assert engine.statistics().workers_alive == 1
                await engine.generate(request("sd", seed=3))
        assert isinstance(failed.value.__cause__, ParallelGroupError)
    flag.unlink()
    nothing_left(before, before_listening, ranks)


@pytest.mark.anyio
async def test_a_load_on_a_group_whose_rank_died_fails_clearly_and_the_server_answers_on(
    tmp_path: Path,
) -> None:
    """L49 (L85), L23: a rank killed while its group idles: a load on the runner raises
    the group's error naming the rank, and rank 0 keeps nothing of it; through a server
    the load is a 503 ``engine_dead`` (never that ``BaseException``, which would end the
    server), ``/health`` says ``dead``, leaving it raises ``EngineDeadError``, and every
    rank process is reaped."""
    tiny_lora(tiny("sd"), tmp_path, "ink", seed=1)
    before, before_listening = children(), set(listening([os.getpid()]))
    with group("sd", "cfg", timeout_s=10.0) as runner:
        ranks = set(runner.pids)
        os.kill(runner.pids[0], signal.SIGKILL)
        with anyio.fail_after(BUDGET):
            await wait_until(lambda: not alive(runner.pids[0]))
        with pytest.raises(ParallelGroupError, match="rank 1 was killed by signal 9"):
            runner.load_adapter("ink", tmp_path / "ink.safetensors")
        assert runner.adapters() == ()
        config = ServeConfig(
            model_name="tiny-sd", allow_adapter_admin=True, adapter_dir=str(tmp_path)
        )
        with anyio.fail_after(BUDGET), pytest.raises(ot.EngineDeadError):
            async with serving(Service(runner, config=config)) as client:
                body = {"name": "ink", "path": "ink.safetensors"}
                response = await client.post("/v1/adapters", json=body)
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "engine_dead"
                health = await client.get("/health")
                assert (health.status_code, health.json()["status"]) == (503, "dead")
    nothing_left(before, before_listening, ranks)


def test_a_failed_start_raises_and_leaves_no_process() -> None:
    """L41: a rank whose factory raises fails the start at once with
    ``ParallelStartError`` naming the rank and its error; nothing is left running or
    listening."""
    before, before_listening = children(), set(listening([os.getpid()]))
    factory = functools.partial(raises_in_ranks, "sd")
    with pytest.raises(ParallelStartError) as failed, group("sd", "cfg", factory=factory):
        pass
    assert "rank 1 failed to start" in str(failed.value)
    assert "cannot load the model" in str(failed.value)
    nothing_left(before, before_listening, set())


_ENGINE_PROCESS = textwrap.dedent(
    """
    import functools, os, signal
    from omni_trio.parallel import ParallelRunner
    from omni_trio.runners import tiny_pipeline

    if __name__ == "__main__":
        runner = ParallelRunner(functools.partial(tiny_pipeline, "sd"), cfg=2)
        print(*runner.pids, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
def test_a_killed_engine_process_takes_its_ranks_with_it() -> None:
    """L41, L49: the engine's process killed (SIGKILL: no close, no atexit): its ranks die
    with it (the parent-death signal), none is left behind."""
    engine = subprocess.run(
        [sys.executable, "-c", _ENGINE_PROCESS],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert engine.returncode == -signal.SIGKILL, engine.stderr[-2000:]
    ranks = [int(pid) for pid in engine.stdout.split()]
    assert ranks
    assert not wait_gone(ranks, within=30.0)


@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_ltx_video_is_refused_for_sequence_parallel(layout: str) -> None:
    """L48: LTX-Video has diffusers' context-parallel plan, but its split output is wrong
    (Ulysses raised in its cross-attention; ring made another video): the group refuses
    it at start with ``TypeError`` saying so and naming the layout that works (cfg);
    nothing is left running or listening."""
    before, before_listening = children(), set(listening([os.getpid()]))
    with pytest.raises(TypeError) as refused, group("ltx", layout):
        pass
    assert "LTX-Video is not supported" in str(refused.value)
    assert "(cfg)" in str(refused.value)
    nothing_left(before, before_listening, set())
