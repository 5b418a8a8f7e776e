"""Regional compilation (L90, L93): the denoiser's blocks compiled, every feature outside.

Determinism rules:
- compiling is slow (a cold compile of tiny Flux's two block classes takes 20-80 s on
  a CPU), so the module shares one compile cache folder (``use_compile_cache``) and
  one pipeline, and the tests are few; what is compiled is counted with dynamo's own
  counters (graphs made, graph breaks), never timed;
- outputs are compared with the same requests on an eager runner of the same
  pipeline (one torch thread): inductor's kernels add in another order, so the
  images agree to 1e-4, not bitwise;
- the batches are made by submitting while a request is held (``GatedRunner``-style
  gates are not used: the engine's own batching with requests of different steps
  makes joins and leaves at known boundaries).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import omni_trio as ot
from omni_trio import AdapterError
from omni_trio.runners import DiffusersRunner, tiny_lora, tiny_pipeline
from omni_trio.testing import probe
from tests.support.core import BUDGET
from tests.support.runners import compile_cache_in, dynamo_counts, images_together

#: How far a compiled step's image may be from the eager one's (images in [0, 1]).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One tiny Flux for the module, its compile caches in a folder of the session's."""
    with compile_cache_in(tmp_path_factory.mktemp("compile-cache")):
        yield tiny_pipeline("flux", seed=0)


def request(seed: int, steps: int, size: int = 32, **fields: Any) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a fox {seed}", num_steps=steps, height=size, width=size, seed=seed,
        guidance_scale=3.5, **fields,
    )  # fmt: skip


@pytest.mark.anyio
async def test_a_churning_batch_after_the_warm_up_compiles_nothing_and_stalls_nothing(
    pipe: Any, one_torch_thread: None
) -> None:
    """L90: warmed at one and two rows, then sealed: batches of 1 to 3 rows that join and
    leave at every boundary, rows a step cache skips (the tail runs the computing rows
    only), and an undeclared resolution make no new graph (the last runs eager) and no
    graph break; every image equals the eager runner's within 1e-4."""
    runner = DiffusersRunner(pipe, compile="blocks", max_batch_size=3)
    assert runner.compiled_blocks == 2  # tiny Flux: one double and one single block
    with anyio.fail_after(BUDGET * 6):
        await images_together(runner, [request(0, 2), request(1, 2)])  # compiles B=1, B>=2
    runner = DiffusersRunner(pipe, compile="blocks", max_batch_size=3)
    runner.seal_compile()
    before = dynamo_counts()
    churn = [
        request(2, 4),
        request(3, 2),
        request(4, 3, cache=ot.StepCache(kind="first-block", threshold=0.4)),
        request(5, 5),
        request(6, 2, size=48),  # undeclared: no graph of its shape; it runs eager
    ]
    with anyio.fail_after(BUDGET * 2):
        compiled = await images_together(runner, churn)
    assert dynamo_counts() == before
    with anyio.fail_after(BUDGET):
        eager = await images_together(DiffusersRunner(pipe, max_batch_size=3), churn)
    for mine, theirs in zip(compiled, eager, strict=True):
        assert (mine - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.anyio
async def test_an_abort_lands_at_a_block_of_a_compiled_step(pipe: Any) -> None:
    """L90, L71: the cancel point before each block stays eager: a request aborted while
    its second step runs is left at the next block (fewer blocks ran than two steps
    have), released undecoded after one step."""
    runner = DiffusersRunner(pipe, compile="blocks", max_batch_size=3)
    runner.seal_compile()
    blocks = list(pipe.transformer.transformer_blocks) + list(
        pipe.transformer.single_transformer_blocks
    )
    calls: list[int] = []
    reached = threading.Event()
    asked: list[ot.RequestHandle] = []

    def count(module: torch.nn.Module, args: object) -> None:
        calls.append(blocks.index(module))
        if len(calls) == len(blocks) + 1:  # the second step's first block: hold it
            reached.set()  # until the loop asked for the abort
            deadline = time.monotonic() + BUDGET
            while probe(asked[0]).cancel_reason is None and time.monotonic() < deadline:
                time.sleep(0.001)

    hooks = [block.register_forward_pre_hook(count) for block in blocks]
    try:
        with anyio.fail_after(BUDGET * 2):
            async with ot.open_engine(runner) as engine:
                handle = engine.submit(request(7, 4), request_id="aborted")
                asked.append(handle)
                async with handle:
                    assert await anyio.to_thread.run_sync(reached.wait, BUDGET)
                    handle.abort_nowait()
                    with pytest.raises(ot.RequestAbortedError):
                        await handle.result()
    finally:
        for hook in hooks:
            hook.remove()
    assert handle.metrics is not None and handle.metrics.steps_done == 1
    assert len(blocks) < len(calls) < 2 * len(blocks)  # left inside the second step


def test_a_compiled_runner_refuses_adapters_by_name(pipe: Any, tmp_path: Path) -> None:
    """L93: a compiled runner declares no adapters, and a load is refused naming why."""
    runner = DiffusersRunner(pipe, compile="blocks")
    try:
        assert runner.capabilities.max_adapters == 0
        path = tiny_lora(pipe, tmp_path, "ink", seed=1)
        with pytest.raises(AdapterError, match="a compiled runner takes no adapters"):
            runner.load_adapter("ink", path)
    finally:
        runner.close()
    with pytest.raises(ValueError, match="compile: one of blocks"):
        DiffusersRunner(pipe, compile="everything")
