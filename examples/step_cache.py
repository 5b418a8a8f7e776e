"""Skip work between steps with a per-request step cache, and see what it skipped.

Three requests share every step of one batch on tiny Flux: one uncached, one with a
first-block cache, one with a TaylorSeer forecast. Each request's cache decides for
its own rows only, so its skips are the same as it would have alone (L81); its
metrics say how many model calls and blocks it computed and skipped (L84). The
threshold is high because tiny random weights change a lot per step (their ratio is
0.2-0.5); a real checkpoint's threshold is about 0.05-0.1.

Usage: .venv/bin/python examples/step_cache.py   (seconds on a CPU)
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("flux"))
    print(f"{runner.family} applies: {sorted(runner.capabilities.step_cache)}")
    policies = {
        "uncached": None,
        "first-block": ot.StepCache(kind="first-block", threshold=0.5),
        "taylorseer": ot.StepCache(kind="taylorseer", interval=3),
    }
    config = ot.EngineConfig(max_batch_size=3)
    async with ot.open_engine(runner, config) as engine:
        handles = {
            name: engine.submit(
                ot.GenerationRequest(
                    prompt="a lighthouse", num_steps=12, height=64, width=64, seed=1, cache=policy
                ),
                request_id=name,
            )
            for name, policy in policies.items()
        }
        for name, handle in handles.items():
            async with handle:
                output = await handle.result()
            cache = output.metrics.cache
            if cache is None:
                print(f"{name:12s} every block of every step")
                continue
            # block_fraction is the share of the block work that ran (a skip runs one block).
            print(
                f"{name:12s} {cache.pattern[0]}  skipped {cache.calls_skipped} of"
                f" {cache.calls_computed + cache.calls_skipped} calls,"
                f" computed {cache.block_fraction:.0%} of the block work"
            )


if __name__ == "__main__":
    anyio.run(main, backend="trio")
