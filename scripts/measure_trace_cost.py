"""What a request's trace costs (L99): the CPU time the server spends on its spans.

Runs 50 requests of the fake runner (4 steps, 64x64) for their metrics, then writes
each one's spans (the route's, ``diffusion_request`` and its wait, run, decode and
response) through OpenTelemetry's SDK with a batch processor, as ``serve`` does, 20
rounds; prints the median and the fastest round's time per request. The spans are
written once the request is terminal, in the event loop: nothing runs in the step loop.

Usage: .venv/bin/python scripts/measure_trace_cost.py   (the trace extra installed)
"""

from __future__ import annotations

import statistics
import sys
import time

import anyio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import omni_trio as ot
from omni_trio.serve._tracing import Tracing
from omni_trio.testing import FakeRunner

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def main() -> None:
    request = ot.GenerationRequest(prompt="a", num_steps=4, height=64, width=64, seed=1)
    async with ot.open_engine(FakeRunner()) as engine:
        outputs = [await engine.generate(request) for _ in range(50)]
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing = Tracing(provider)
    rounds = []
    for _ in range(20):
        started = time.perf_counter()
        for output in outputs:
            with tracing.route(
                "POST", "/v1/images/generations", {"traceparent": TRACEPARENT}
            ) as span:
                tracing.request(
                    span,
                    request=request,
                    request_id=output.request_id,
                    model="fake",
                    outcome="completed",
                    metrics=output.metrics,
                    answered_ns=time.time_ns(),
                )
                Tracing.status(span, 200)
        rounds.append((time.perf_counter() - started) / len(outputs))
    provider.force_flush()
    spans = len(exporter.get_finished_spans()) // (20 * len(outputs))
    sys.stdout.write(
        f"{spans} spans a request: median {statistics.median(rounds) * 1e6:.0f} us,"
        f" fastest round {min(rounds) * 1e6:.0f} us a request\n"
    )


if __name__ == "__main__":
    anyio.run(main)
