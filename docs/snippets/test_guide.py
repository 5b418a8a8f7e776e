import anyio, pytest
import omni_trio as ot
from omni_trio.testing import GatedRunner, assert_engine_idle

@pytest.mark.anyio
async def test_abort_lands_at_next_step():
    runner = GatedRunner()
    with anyio.fail_after(10):
        async with ot.open_engine(runner) as engine:
            async with engine.submit(ot.GenerationRequest(num_steps=10, height=16, width=16),
                                     request_id="r") as handle:
                runner.release(1)
                await runner.wait_arrived(2)      # the worker is inside step 2
                engine.abort_nowait("r")
                runner.release(1)
                with pytest.raises(ot.RequestAbortedError):
                    await handle.result()
                assert handle.metrics.steps_done == 2
            assert runner.live_states == 0
            assert_engine_idle(engine)
