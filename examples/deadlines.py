"""Priorities, deadlines and preemption on one busy worker.

A long background request holds the only slot (``max_batch_size=1``). A request whose
deadline cannot be met behind it is refused at ``submit`` with ``DeadlineError`` (L62);
an urgent one (higher priority) suspends the long one at the next step boundary, runs,
and the long one resumes from the step it reached (L61).
"""

import anyio

import omni_trio as ot
from omni_trio.testing import FakeRunner


def request(steps: int, priority: int = 0, deadline_s: float | None = None) -> ot.GenerationRequest:
    return ot.GenerationRequest(
        prompt="x", num_steps=steps, height=16, width=16, priority=priority, deadline_s=deadline_s
    )


async def main() -> None:
    runner = FakeRunner(step_seconds=0.01)
    async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
        async with engine.submit(request(100), request_id="background") as background:
            async for event in background:
                if event.step == 3:  # a few steps measured: the estimate knows the step time
                    break
            try:
                engine.submit(request(4, deadline_s=0.05), request_id="hopeless")
            except ot.DeadlineError as exc:
                print(f"refused at submit: {exc.estimate_s:.2f} s needed, 0.05 s allowed")
            urgent = await engine.generate(request(4, priority=5, deadline_s=5.0))
            print(f"urgent: done in {urgent.metrics.total_s:.2f} s")
            print("background now:", background.status.name)
            done = await background.result()
        metrics = done.metrics
        print(f"background: {metrics.preemptions} preemption, all {metrics.steps_done} steps")


if __name__ == "__main__":
    anyio.run(main, backend="trio")
