"""OpenTelemetry traces of requests (L99): spans written from a request's timeline.

Determinism rules:
- spans are read from the SDK's in-memory exporter (a simple span processor: each
  span is exported when it ends), or received over OTLP/HTTP by a receiver this test
  runs on 127.0.0.1 (``tests.support.otlp``); the provider is flushed before anything
  is read;
- requests run on ``FakeRunner`` (instant) or ``GatedRunner`` (the test releases each
  step), so the parts of each life are there, whatever their durations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import omni_trio as ot
from omni_trio.serve._tracing import REQUEST_SPAN, Tracing
from omni_trio.testing import FakeRunner, GatedRunner
from tests.support.core import BUDGET, req
from tests.support.otlp import receiving

#: A client's trace context (W3C ``traceparent``): trace id, its span, sampled.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def spans() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(provider), exporter
    provider.shutdown()


def by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in finished:
        named.setdefault(span.name, []).append(span)
    return named


@pytest.mark.anyio
async def test_a_requests_span_has_its_wait_runs_decode_and_response_under_the_route(
    spans: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """L99: under a route's SERVER span that continues the client's traceparent, a
    request's span holds a wait, a run per segment, a decode and a response, in order;
    it says what the request was and came to, and holds no prompt unless asked; its
    prompt cache's figures where its runner reported them (L94)."""
    tracing, exporter = spans
    request = req(prompt="a secret fox", num_steps=3, tenant="acme", seed=1)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(FakeRunner()) as engine:
            out = await engine.generate(request, request_id="r1")
    with tracing.route("POST", "/v1/images/generations", {"traceparent": TRACEPARENT}) as route:
        tracing.request(
            route, request=request, request_id="r1", model="fake", outcome="completed",
            metrics=out.metrics, answered_ns=None,
        )  # fmt: skip
        Tracing.status(route, 200)
    named = by_name(exporter.get_finished_spans())
    assert sorted(named) == sorted(["POST /v1/images/generations", REQUEST_SPAN, "wait",
                                    "run", "decode"])  # fmt: skip
    [server] = named["POST /v1/images/generations"]
    [span] = named[REQUEST_SPAN]
    assert server.context is not None and span.context is not None and span.parent is not None
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == CLIENT_SPAN
    assert span.parent.span_id == server.context.span_id
    assert server.attributes is not None and server.attributes["http.response.status_code"] == 200
    attributes = dict(span.attributes or {})
    assert attributes["omni_trio.request_id"] == "r1"
    assert attributes["omni_trio.outcome"] == "completed"
    assert attributes["omni_trio.tenant"] == "acme"
    assert attributes["omni_trio.steps_done"] == 3
    assert "omni_trio.prompt" not in attributes
    assert not any(name.startswith("omni_trio.prompt_cache.") for name in attributes)
    assert not any("a secret fox" in str(value) for value in attributes.values())
    wait, run, decode = named["wait"][0], named["run"][0], named["decode"][0]
    for child in (wait, run, decode):
        assert child.parent is not None and child.parent.span_id == span.context.span_id
    assert span.start_time is not None and span.end_time is not None
    assert wait.start_time == span.start_time
    assert wait.end_time == run.start_time and run.end_time == decode.start_time
    assert decode.end_time == span.end_time
    tracing.prompts = True
    tracing.request(None, request=request, request_id="r1", model="fake",
                    outcome="completed", metrics=out.metrics)  # fmt: skip
    last = by_name(exporter.get_finished_spans())[REQUEST_SPAN][-1]
    assert last.parent is None and dict(last.attributes or {})["omni_trio.prompt"] == "a secret fox"
    figures = ot.PromptCacheMetrics(hits=1, misses=2, encode_s=0.5, saved_s=0.25)
    tracing.request(None, request=request, request_id="r1", model="fake", outcome="completed",
                    metrics=dataclasses.replace(out.metrics, prompt_cache=figures))  # fmt: skip
    last = by_name(exporter.get_finished_spans())[REQUEST_SPAN][-1]
    attributes = dict(last.attributes or {})
    assert {name: attributes[name] for name in attributes if ".prompt_cache." in name} == {
        "omni_trio.prompt_cache.hits": 1,
        "omni_trio.prompt_cache.misses": 2,
        "omni_trio.prompt_cache.encode_s": 0.5,
        "omni_trio.prompt_cache.saved_s": 0.25,
    }


@pytest.mark.anyio
async def test_a_suspended_request_has_a_run_per_segment_and_an_aborted_one_only_waits(
    spans: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """L99, L61: a request suspended once has two runs and two waits (the second marked
    suspended); one aborted while it waited has one wait and no run, no decode."""
    tracing, exporter = spans
    runner = GatedRunner()
    low_request, high_request = req(num_steps=2), req(num_steps=1, priority=5)
    with anyio.fail_after(BUDGET):
        async with ot.open_engine(runner, ot.EngineConfig(max_batch_size=1)) as engine:
            low = engine.submit(low_request, request_id="low")
            await runner.wait_arrived(1)
            high = engine.submit(high_request, request_id="high")
            runner.release(1)
            await runner.wait_arrived(2)
            runner.open_gate()
            async with low, high:
                await low.result()
                await high.result()
            aborted_request = req(num_steps=1)
            aborted = engine.submit(aborted_request, request_id="gone")
            async with aborted:
                aborted.abort_nowait()
    for handle, request in ((low, low_request), (aborted, aborted_request)):
        tracing.request(None, request=request, request_id=handle.request_id, model="fake",
                        outcome=handle.status.value, metrics=handle.metrics)  # fmt: skip
    named = by_name(exporter.get_finished_spans())
    low_span, gone_span = named[REQUEST_SPAN]
    assert low_span.context is not None and gone_span.context is not None

    def children(span: ReadableSpan, name: str) -> list[ReadableSpan]:
        assert span.context is not None
        return [
            s for s in named.get(name, []) if s.parent and s.parent.span_id == span.context.span_id
        ]

    assert len(children(low_span, "run")) == 2
    waits = children(low_span, "wait")
    assert [dict(w.attributes or {})["suspended"] for w in waits] == [False, True]
    assert dict(low_span.attributes or {})["omni_trio.preemptions"] == 1
    assert len(children(gone_span, "wait")) == 1
    assert children(gone_span, "run") == [] and children(gone_span, "decode") == []
    assert dict(gone_span.attributes or {})["omni_trio.outcome"] == "aborted"


def test_tracing_is_off_unless_an_exporter_is_named() -> None:
    """L99: without ``OTEL_TRACES_EXPORTER`` (or with ``none``) nothing is traced and every
    call is a no-op; an exporter the server does not ship is one line."""
    for environ in ({}, {"OTEL_TRACES_EXPORTER": "none"}):
        tracing = Tracing.from_environment(environ=environ)
        assert not tracing.enabled
        with tracing.route("GET", "/health", {"traceparent": TRACEPARENT}) as span:
            assert span is None
    with pytest.raises(ValueError, match="by otlp or console, got 'zipkin'"):
        Tracing.from_environment(environ={"OTEL_TRACES_EXPORTER": "zipkin"})


@pytest.mark.anyio
async def test_spans_reach_an_otlp_http_receiver_configured_by_the_environment() -> None:
    """L99: with ``OTEL_TRACES_EXPORTER=otlp`` and ``OTEL_EXPORTER_OTLP_ENDPOINT``, a
    request's spans are sent over OTLP/HTTP to that endpoint (here a receiver on
    127.0.0.1) by the time the tracer shuts down."""
    with receiving() as receiver:
        environ = {"OTEL_TRACES_EXPORTER": "otlp",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            for name, value in environ.items():
                patch.setenv(name, value)
            tracing = Tracing.from_environment()
        request = req(num_steps=2)
        with anyio.fail_after(BUDGET):
            async with ot.open_engine(FakeRunner()) as engine:
                out = await engine.generate(request, request_id="sent")
        tracing.request(None, request=request, request_id="sent", model="fake",
                        outcome="completed", metrics=out.metrics)  # fmt: skip
        await anyio.to_thread.run_sync(tracing.shutdown)
    assert sorted(span.name for span in receiver.spans) == sorted(
        [REQUEST_SPAN, "wait", "run", "decode"]
    )


@pytest.mark.anyio
async def test_the_routes_trace_images_refusals_and_video_jobs(
    spans: tuple[Tracing, InMemorySpanExporter],
) -> None:
    """L99: through the HTTP app, an image request's span is the child of its route's
    SERVER span, which continues the client's traceparent; a refused body is its route's
    span with the status; a video job's span, written when the job ends, is the child of
    the route that made it."""
    from omni_trio.serve import ServeConfig, Service
    from tests.support.serve import serving

    tracing, exporter = spans
    images = Service(
        FakeRunner(),
        config=ServeConfig(model_name="fake", default_width=16, default_height=16),
        tracing=tracing,
    )
    with anyio.fail_after(BUDGET):
        async with serving(images) as client:
            ok = await client.post(
                "/v1/images/generations",
                json={"prompt": "a fox", "num_inference_steps": 2},
                headers={"traceparent": TRACEPARENT},
            )
            bad = await client.post("/v1/images/generations", json={"prompt": 3})
    assert (ok.status_code, bad.status_code) == (200, 400)
    named = by_name(exporter.get_finished_spans())
    route, refused = named["POST /v1/images/generations"]
    [span] = named[REQUEST_SPAN]
    assert route.context is not None and span.parent is not None
    assert format(route.context.trace_id, "032x") == TRACE_ID
    assert span.parent.span_id == route.context.span_id
    assert [s.name for s in named["response"]] == ["response"]
    assert dict(refused.attributes or {})["http.response.status_code"] == 400
    exporter.clear()
    from tests.support.jobs import RULE, create, finished

    videos = Service(
        FakeRunner(frames=RULE),
        config=ServeConfig(model_name="fake-video", default_width=16, default_height=16),
        tracing=tracing,
    )
    with anyio.fail_after(BUDGET):
        async with serving(videos) as client:
            job = await create(client, num_frames=5)
            await finished(client, job["id"])
    named = by_name(exporter.get_finished_spans())
    [made] = named["POST /v1/videos"]
    [video] = named[REQUEST_SPAN]
    assert made.context is not None and video.parent is not None
    assert video.parent.span_id == made.context.span_id
    assert dict(video.attributes or {})["omni_trio.request_id"] == job["id"]
