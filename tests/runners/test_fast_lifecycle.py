"""The lifecycle with compilation and quantization both on (L93): tiny Flux, int8-dynamic,
its blocks compiled (``compile="blocks"``) and sealed after one warm-up, through the
rules a request's life crosses: joins and leaves at every boundary with a per-row step
cache (L80-L84), an abort left at a block (L71), a deadline passing mid-run (L62),
preemption with exact resume (L61), a checkpoint restored in a fresh engine (L78), two
workers each over its own pipeline (L42). What cannot hold is refused at start by name:
a second compiled runner over a pipeline a live one holds (here), adapters on a
compiled runner
(test_compile.py::test_a_compiled_runner_refuses_adapters_by_name) and a quantized or
compiled parallel group (test_quantize.py::test_what_cannot_run_is_refused_in_one_line_by_name).

Determinism rules:
- compiling is slow (a cold compile of the int8 blocks at one and at two rows is
  40-120 s on this CPU), so the module compiles once: one pipeline, one compile cache
  folder (``use_compile_cache``), the warm-up's shapes made by stepping the runner
  directly (one row, then two: the batch of one's graph, then torch's automatic
  dynamic one for every larger batch); each engine then gets a fresh runner over it,
  sealed (an engine closes its runner), which finds the graphs made;
- after the warm-up nothing is compiled: dynamo's own counters (graphs made, graph
  breaks) are read around each test, never a time; torch's stance is the process's
  ``default`` after every test;
- tolerance: the same request at the same batch size runs the same kernels on the same
  inputs, so a preempted, restored or aborted-then-served request (batches of one both
  ways) and a request on either of two workers equal their references bitwise. A
  batched row runs another graph (torch's dynamic one) than its batch of one: measured
  here, equal bitwise too (40 requests in batches of 1 to 3), but nothing makes another
  CPU's kernels for the two shapes round alike, and an activation a float rounding
  apart can land a quantization level apart (2.5e-3 of an image at most, as quantized
  and compiled against eager in test_quantize.py). So a batched image is asserted
  within 5e-3 of its batch of one, far below what a wrong row, a lost step or a wrong
  skip changes (another seed's image differs by about 0.5);
- where a request stops is fixed by holding a block's call (``ModuleGate``) until the
  loop has asked for the stop; one torch thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from torch._dynamo import eval_frame

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline
from omni_trio.runners._quantize import quantize_pipeline
from omni_trio.testing import probe, wait_until
from tests.support.core import BUDGET
from tests.support.runners import (
    ModuleGate,
    abort_inside,
    compile_cache_in,
    dynamo_counts,
    generated_at_once,
)

# The module's first test, whichever it is, makes the graphs (its setup: 40-120 s).
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

#: How far a batched row's image may be from its batch of one (images in [0, 1]).
TOLERANCE = 5e-3


def request(seed: int, steps: int = 4, size: int = 32, **fields: Any) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a fox {seed}", num_steps=steps, height=size, width=size, seed=seed,
        guidance_scale=3.5, **fields,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Tiny Flux, int8-dynamic, its blocks' graphs made at one and two rows."""
    with compile_cache_in(tmp_path_factory.mktemp("fast-compile-cache")):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the kernels the tests run
        quantized = quantize_pipeline(tiny_pipeline("flux", seed=0), "int8-dynamic", None)
        runner = DiffusersRunner(quantized, compile="blocks", max_batch_size=2)
        try:
            for batch in ([request(0, 1)], [request(1, 1), request(2, 1)]):
                states = [runner.prepare(r, f"warm-{r.seed}") for r in batch]
                runner.step(states)
                for state in states:
                    runner.discard(state)
        finally:
            runner.close()
            torch.set_num_threads(threads)
        yield quantized


def sealed(pipe: Any, max_batch_size: int = 3) -> DiffusersRunner:
    """A runner over the compiled blocks that compiles nothing more (L90)."""
    runner = DiffusersRunner(pipe, compile="blocks", max_batch_size=max_batch_size)
    runner.seal_compile()
    return runner


_references: dict[str, torch.Tensor] = {}


async def references(pipe: Any, requests: list[ot.GenerationRequest]) -> list[torch.Tensor]:
    """Each request alone (a batch of one) on a sealed runner; computed once per request."""
    missing = [r for r in requests if repr(r) not in _references]
    if missing:
        async with ot.open_engine(sealed(pipe, 1)) as engine:
            for r in missing:
                _references[repr(r)] = (await engine.generate(r)).images
    return [_references[repr(r)] for r in requests]


def blocks(pipe: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Tiny Flux's two blocks: the double one (first of a step), the single one."""
    return pipe.transformer.transformer_blocks[0], pipe.transformer.single_transformer_blocks[0]


async def release_once_asked(gate: ModuleGate, handle: ot.RequestHandle) -> None:
    """Let the held block go once the loop asked the request to stop."""
    await gate.wait_arrived()
    await wait_until(lambda: probe(handle).cancel_reason is not None)
    gate.release()


async def churn(pipe: Any) -> None:
    """L80, L81, L93: batches of up to 3 that join and leave at every boundary (steps 2 to
    5), one row first-block cached: each image within TOLERANCE of its batch of one,
    the cached row skipping, with the same pattern as alone."""
    policy = ot.StepCache(kind="first-block", threshold=0.4)
    requests = [request(2), request(3, 2), request(4, 3, cache=policy), request(5, 5)]
    async with ot.open_engine(sealed(pipe), ot.EngineConfig(max_batch_size=3)) as engine:
        outputs = await generated_at_once(engine, requests)
        alone = await engine.generate(requests[2])  # the cached row alone
    for output, reference in zip(outputs, await references(pipe, requests), strict=True):
        assert (output.images - reference).abs().max().item() <= TOLERANCE
    cached = outputs[2].metrics.cache
    assert cached is not None and any("S" in row for row in cached.pattern)
    assert alone.metrics.cache is not None and alone.metrics.cache.pattern == cached.pattern


async def abort_at_a_block(pipe: Any) -> None:
    """L71, L90: a request aborted while its second step's first block runs is left at the
    next block (the single block ran once), released undecoded after one step; the
    next request equals a fresh engine's bitwise."""
    double, single = blocks(pipe)
    singles = ModuleGate(single, at=10**6)  # counts only
    try:
        gate, runner, handle, output, fresh = await abort_inside(
            lambda p: double, 2, pipe=pipe, first=request(7), after=request(8, 2),
            compile="blocks",
        )  # fmt: skip
    finally:
        singles.remove()
    assert handle.metrics is not None and handle.metrics.steps_done == 1
    assert (gate.calls, gate.finished, singles.calls) >= (2, 2, 1)
    assert runner.decodes == 1  # the next request's only
    assert torch.equal(output.images, fresh.images)
    [reference] = await references(pipe, [request(8, 2)])
    assert torch.equal(output.images, reference)


async def deadline_mid_run(pipe: Any) -> None:
    """L62, L71: in a batch of two, one row's deadline passes while the second step runs:
    the step finishes for the other, the late one drops at its end undecoded (reason
    ``deadline``) and the other's image is within TOLERANCE of its batch of one."""
    double, _ = blocks(pipe)
    runner = sealed(pipe)
    gate = ModuleGate(double, at=2)  # the batch's second step
    late, other = request(9, deadline_s=1.0), request(10)
    try:
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=3)) as engine:
            async with engine.submit(late) as first, engine.submit(other) as second:
                await release_once_asked(gate, first)
                with pytest.raises(ot.RequestAbortedError) as aborted:
                    await first.result()
                kept = await second.result()
    finally:
        gate.remove()
    assert aborted.value.reason == "deadline"
    assert first.metrics is not None and first.metrics.steps_done <= 2
    assert runner.decodes == 1
    [reference] = await references(pipe, [other])
    assert (kept.images - reference).abs().max().item() <= TOLERANCE


async def preempted_and_resumed(pipe: Any) -> None:
    """L61: batches of one; a request suspended at the end of its second step (parked on
    the host) for one of a higher priority, then resumed, equals its uninterrupted run
    bitwise: the same graphs, the same rows."""
    double, _ = blocks(pipe)
    low, high = request(11), request(12, 2, priority=1)
    gate = ModuleGate(double, at=2)
    options = ot.EngineConfig(max_batch_size=1, park_on_host=True)
    try:
        async with ot.open_engine(sealed(pipe, 1), options) as engine:
            async with engine.submit(low) as first:
                await gate.wait_arrived()
                async with engine.submit(high) as second:
                    gate.release()
                    await second.result()
                resumed = await first.result()
            assert engine.statistics().preemptions == 1
    finally:
        gate.remove()
    assert resumed.metrics.preemptions == 1
    [uninterrupted] = await references(pipe, [low])
    assert torch.equal(resumed.images, uninterrupted)


async def restored(pipe: Any) -> None:
    """L78: a request checkpointed at every boundary and restored from its step-2 copy in a
    fresh engine runs the remaining steps to its uninterrupted image, bitwise."""
    low = request(11)
    taken: list[ot.Checkpoint] = []
    policy = ot.CheckpointPolicy(every_s=0, sink=taken.append)
    async with ot.open_engine(sealed(pipe, 1)) as engine:
        async with engine.submit(low, checkpoint=policy) as handle:
            whole = await handle.result()
    async with ot.open_engine(sealed(pipe, 1)) as engine:
        async with engine.submit(low, resume_from=taken[1].data) as handle:
            again = await handle.result()
    assert taken[1].step == 2
    [uninterrupted] = await references(pipe, [low])
    assert torch.equal(whole.images, uninterrupted)
    assert torch.equal(again.images, uninterrupted)


@pytest.mark.anyio
async def test_a_compiled_quantized_runner_keeps_the_lifecycle(pipe: Any) -> None:
    """L93 with L80-L84, L71, L62, L61, L78 (each scenario's own docstring says what it
    asserts): on the sealed compiled int8 runner, churn with a per-row step cache, an
    abort left at a block, a deadline mid-run, a preemption and a checkpoint restore
    each hold, and none of them compiles a graph or breaks one; torch's stance is the
    process's default after."""
    before = dynamo_counts()
    with anyio.fail_after(BUDGET * 4):
        await references(pipe, [request(2)])
        for scenario in (churn, abort_at_a_block, deadline_mid_run, preempted_and_resumed):
            await scenario(pipe)
        await restored(pipe)
    assert dynamo_counts() == before
    assert eval_frame._stance.stance == "default"


@pytest.mark.anyio
async def test_two_compiled_workers_each_over_its_pipeline_make_one_workers_images(
    pipe: Any,
) -> None:
    """L93, L42, L90: a second compiled runner over a pipeline whose blocks a live runner
    holds compiled is refused by name (workers over one pipeline run its modules at
    once: their images are not one worker's, compiled or not), its hooks let go. Two
    workers, each over its own int8 pipeline (the same weights), sealed, serve one
    queue: each image equals its batch of one bitwise on either worker, an undeclared
    size runs eager, nothing compiles (the graphs are the blocks' code's, made once),
    and torch's stance, one for the process, is its default after (the workers'
    compiled calls take turns: torch's compiler is not thread-safe)."""
    requests = [request(20 + index) for index in range(6)]
    with anyio.fail_after(BUDGET * 2):
        expected = await references(pipe, requests)
        twin = quantize_pipeline(tiny_pipeline("flux", seed=0), "int8-dynamic", None)
        before = dynamo_counts()
        first = sealed(pipe, 1)
        with pytest.raises(ValueError, match="another runner holds this pipeline's compiled"):
            DiffusersRunner(pipe, compile="blocks")
        assert first.compiled_blocks == 2
        config = ot.EngineConfig(max_batch_size=1, torch_threads=1)
        async with ot.open_engine([first, sealed(twin, 1)], config) as engine:
            outputs: list[Any] = [None] * len(requests)

            async def one(index: int) -> None:
                outputs[index] = await engine.generate(requests[index])

            async with anyio.create_task_group() as tasks:
                for index in range(len(requests)):
                    tasks.start_soon(one, index)
            undeclared = await engine.generate(request(26, 2, size=48))
            workers = [worker.steps_run for worker in engine.statistics().workers]
    assert sum(workers) == 4 * len(requests) + 2 and min(workers) > 0
    for output, reference in zip(outputs, expected, strict=True):
        assert torch.equal(output.images, reference)
    assert undeclared.images.shape[-1] == 48
    assert dynamo_counts() == before
    assert eval_frame._stance.stance == "default"
