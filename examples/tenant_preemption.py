"""Tenants preempt each other at one priority: a light tenant's request starts at once.

"heavy" fills a batch of two with long requests (20 steps). "light" sends a short
one (4 steps) of the same priority after their fifth step: at the next boundary
the heavy request admitted last is suspended and the light one takes its place, so
it finishes first; the heavy one resumes from the step it reached, with the image it
makes uninterrupted up to float rounding (it ran beside other requests: batches of
other sizes round differently; alone, as in ``preempt.py``, it is bitwise). With
``EngineConfig(tenant_preemption=False)`` the light request would wait for a heavy one
to end. Requests of one tenant never preempt
each other, and a batch of one never moves its place between tenants.
"""

import anyio

import omni_trio as ot
from omni_trio.runners import DiffusersRunner, tiny_pipeline


def request(tenant: str, steps: int) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a {tenant} job", num_steps=steps, height=64, width=64, seed=3, tenant=tenant
    )


async def main() -> None:
    runner = DiffusersRunner(tiny_pipeline("sd"))
    config = ot.EngineConfig(max_batch_size=2)
    finished: list[str] = []
    async with ot.open_engine(runner, config) as engine:
        alone = await engine.generate(request("heavy", 20))
        heavy = [engine.submit(request("heavy", 20), request_id=f"heavy-{i}") for i in range(2)]
        async for event in heavy[0]:
            if event.step == 5:
                break
        light = engine.submit(request("light", 4), request_id="light")

        outputs: dict[str, ot.GenerationOutput] = {}

        async def wait(handle: ot.RequestHandle) -> None:
            async with handle:
                outputs[handle.request_id] = await handle.result()
            finished.append(handle.request_id)

        async with anyio.create_task_group() as tg:
            for handle in [*heavy, light]:
                tg.start_soon(wait, handle)
    print("finished in order:", ", ".join(finished))
    suspended = outputs["heavy-1"].metrics
    print(
        f"heavy-1: {suspended.preemptions} preemption(s), {suspended.suspended_s:.3f} s suspended"
    )
    gap = (outputs["heavy-1"].images - alone.images).abs().max().item()
    print(f"its image against the uninterrupted one: largest difference {gap:.2g}")
    assert finished[0] == "light", "tenant preemption: light does not wait for a place"


if __name__ == "__main__":
    anyio.run(main, backend="trio")
