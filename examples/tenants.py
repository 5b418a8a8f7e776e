"""Fair share between tenants: a heavy tenant floods the queue, a light one still gets in.

One worker, one request at a time. "heavy" submits twelve requests at once, then
"light" three: with fair share they alternate (heavy, light, heavy, light, ...)
instead of light's waiting behind all of heavy's, as they would first come first
served. Device time is shared by weight, in step-seconds: with ``tenant_weights``
{"heavy": 3} heavy would get three steps for each of light's. Over HTTP, a key's
tenant (``serve --keys-file``) is what sets ``tenant``.
"""

import anyio

import omni_trio as ot
from omni_trio.testing import FakeRunner


def request(tenant: str) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt=f"a {tenant} request", num_steps=4, height=16, width=16, seed=0, tenant=tenant
    )


async def main() -> None:
    runner = FakeRunner(step_seconds=0.002)
    config = ot.EngineConfig(max_batch_size=1, tenant_weights={"heavy": 1.0, "light": 1.0})
    finished: list[str] = []
    async with ot.open_engine(runner, config) as engine:
        handles = [engine.submit(request("heavy"), request_id=f"heavy-{i}") for i in range(12)]
        handles += [engine.submit(request("light"), request_id=f"light-{i}") for i in range(3)]

        async def wait(handle: ot.RequestHandle) -> None:
            async with handle:
                await handle.result()
            finished.append(handle.request_id)

        async with anyio.create_task_group() as tg:
            for handle in handles:
                tg.start_soon(wait, handle)
    print("finished in order:", ", ".join(finished))
    last_light = max(finished.index(f"light-{i}") for i in range(3))
    print(f"light's last request finished {last_light + 1}th of {len(finished)}")
    assert last_light < 8, "fair share: light does not wait behind all of heavy's"


if __name__ == "__main__":
    anyio.run(main, backend="trio")
