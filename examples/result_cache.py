"""Answer exact repeats from a result cache: in memory, then in a folder across a restart.

A request with an explicit seed whose output fields, adapters and model equal an
earlier completed request's gets a copy of that output at ``submit``, without reaching
a worker (L95); its metrics say it was a hit. A request without a seed always runs.
With the default scope, ``"tenant"``, two tenants never share an entry (L96). A cache
in a folder is there again after a restart.

The fake runner stands in for a model (its images depend on the request alone); a
runner of a real model names the model its outputs come from the same way, with its
``result_fingerprint()``.

Usage: .venv/bin/python examples/result_cache.py   (a second on a CPU)
"""

import dataclasses
import tempfile
from typing import Any

import anyio

import omni_trio as ot
from omni_trio.testing import FakeRunner

REQUEST = ot.GenerationRequest(prompt="a lighthouse", num_steps=8, height=64, width=64, seed=7)


async def ask(engine: ot.Engine, label: str, **changes: Any) -> ot.GenerationOutput:
    """Generate ``REQUEST`` with ``changes``; say whether it ran or came from the cache."""
    output = await engine.generate(dataclasses.replace(REQUEST, **changes))
    metrics = output.metrics
    said = "from the cache" if metrics.result_cache_hit else f"ran {metrics.steps_done} steps"
    print(f"{label:20s} {said}")
    return output


async def main() -> None:
    cache = ot.ResultCache(max_bytes=64 * 2**20)
    async with ot.open_engine(FakeRunner(), ot.EngineConfig(result_cache=cache)) as engine:
        first = await ask(engine, "first")
        again = await ask(engine, "the same again")
        same = again.images.numpy().tobytes() == first.images.numpy().tobytes()
        print(f"  equal bytewise: {same}")
        await ask(engine, "another seed", seed=8)
        await ask(engine, "no seed", seed=None)
        await ask(engine, "tenant acme", tenant="acme")
        await ask(engine, "tenant acme again", tenant="acme")
        stats = engine.statistics().result_cache
        assert stats is not None
        print(f"hits {stats.hits}, misses {stats.misses}, {stats.entries} outputs kept")

    with tempfile.TemporaryDirectory() as folder:
        on_disk = ot.EngineConfig(result_cache=dataclasses.replace(cache, folder=folder))
        for label in ("before a restart", "after a restart"):
            async with ot.open_engine(FakeRunner(), on_disk) as engine:
                await ask(engine, label)


if __name__ == "__main__":
    anyio.run(main, backend="trio")
