"""OpenTelemetry traces of a server's requests (L99): spans from the lifecycle's own record.

A request's trace is one span, ``diffusion_request``, with a child for each part of
its life: ``wait`` (from its admission to its first run, and between two runs of a
suspended request, L61), ``run`` (each run segment on its worker), ``decode`` (its
last step to its output) and ``response`` (its output to the answer). Under an HTTP
route, the request's span is the child of the route's ``SERVER`` span, which continues
the client's W3C ``traceparent`` (a Ray Serve replica's route, behind the proxy, too).

Nothing is added to the step loop: the engine already keeps when each part happened
(``RequestMetrics.timeline``), and the spans are written from it, with their own start
and end times, once the request is terminal. The cost is a few spans per request,
none per step.

What a span holds: the request's id, model, size, frames, images, steps, tenant, its
outcome, queue wait, preemptions, the calls its step cache skipped, its prompt cache's
hits and misses and the encoder seconds they took and saved (L94), and its adapters by
name; its prompt only when asked (``trace_prompts``); never a key (the routes record
the method, the route and the status only).

Configured as OpenTelemetry's own SDK is: ``OTEL_TRACES_EXPORTER`` (``otlp``, which
sends OTLP over HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; ``console``; ``none``), ``OTEL_SERVICE_NAME``
and ``OTEL_RESOURCE_ATTRIBUTES``: ``Tracing.from_environment``. Tracing is off unless
``OTEL_TRACES_EXPORTER`` names an exporter, or a tracer provider is given. Needs the
``trace`` extra (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``),
imported only when tracing is on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._outputs import RequestMetrics
    from .._request import GenerationRequest

__all__ = ["REQUEST_SPAN", "Tracing"]

_log = logging.getLogger("omni_trio.serve")

#: The name of a request's span (the name the peers' traces give it too).
REQUEST_SPAN = "diffusion_request"

#: ``OTEL_TRACES_EXPORTER`` values that keep tracing off.
_OFF = ("", "none")


class Tracing:
    """A server's tracer, or none (every call is then a no-op).

    Args:
        provider: an OpenTelemetry ``TracerProvider`` (the SDK's); ``None``: off.
        prompts: put each request's prompt on its span (``trace_prompts``).
    """

    def __init__(self, provider: Any | None = None, *, prompts: bool = False) -> None:
        self.provider = provider
        self.prompts = prompts
        self._tracer: Any = None
        if provider is not None:
            self._tracer = provider.get_tracer("omni_trio")

    @classmethod
    def from_environment(
        cls, *, prompts: bool = False, environ: Mapping[str, str] | None = None
    ) -> Tracing:
        """The tracer the standard ``OTEL_*`` variables configure; off unless
        ``OTEL_TRACES_EXPORTER`` names an exporter.

        Raises:
            ValueError: it names an exporter this server does not ship, or the
                ``trace`` extra is not installed; the message says which, in one line.
        """
        environ = os.environ if environ is None else environ
        exporters = [
            name.strip()
            for name in environ.get("OTEL_TRACES_EXPORTER", "").lower().split(",")
            if name.strip() not in _OFF
        ]
        if not exporters:
            return cls()
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        except ImportError:
            raise ValueError(
                "OTEL_TRACES_EXPORTER is set but OpenTelemetry is not installed:"
                " pip install 'omni_trio[trace]'"
            ) from None
        provider = TracerProvider(resource=Resource.create())
        for name in exporters:
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            elif name == "console":
                provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
            else:
                raise ValueError(
                    f"OTEL_TRACES_EXPORTER: this server exports traces by otlp or console,"
                    f" got {name!r}"
                )
        _log.info("traces are exported (%s)", ", ".join(exporters))
        return cls(provider, prompts=prompts)

    @property
    def enabled(self) -> bool:
        """Whether spans are made."""
        return self._tracer is not None

    @contextmanager
    def route(self, method: str, route: str, headers: Mapping[str, str]) -> Iterator[Any]:
        """A ``SERVER`` span around one HTTP request, the child of the client's
        ``traceparent`` if it sent one; yields it (``None`` when off), for
        ``request``'s parent and ``status``.

        ``headers``: the request's, lower-case names; only the trace context is read.
        """
        if self._tracer is None:
            yield None
            return
        from opentelemetry import propagate, trace

        context = propagate.extract(dict(headers))
        with self._tracer.start_as_current_span(
            f"{method} {route}",
            context=context,
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
            record_exception=False,
        ) as span:
            yield span

    @staticmethod
    def status(span: Any, code: int) -> None:
        """Record the response's status on a ``route`` span (``None``: off)."""
        if span is not None:
            span.set_attribute("http.response.status_code", code)

    def request(
        self,
        parent: Any,
        *,
        request: GenerationRequest,
        request_id: str,
        model: str,
        outcome: str,
        metrics: RequestMetrics | None,
        answered_ns: int | None = None,
    ) -> None:
        """Write the spans of one terminal request, under ``parent`` (a ``route`` span, or
        ``None``: a trace of its own), from its ``metrics.timeline``.

        ``outcome``: what the request came to (``completed``, ``aborted``, ...);
        ``answered_ns``: when its answer was sent (``time.time_ns()``), which ends the
        ``response`` span and the request's.
        """
        if self._tracer is None or metrics is None or metrics.timeline is None:
            return
        from opentelemetry import trace

        timeline = metrics.timeline
        start = timeline.admitted_ns

        def at(seconds: float) -> int:
            return start + round(seconds * 1e9)

        ended = at(timeline.ended_s)
        end = max(ended, answered_ns or ended)
        context = None if parent is None else trace.set_span_in_context(parent)
        span = self._tracer.start_span(
            REQUEST_SPAN,
            context=context,
            start_time=start,
            attributes=self._attributes(request, request_id, model, outcome, metrics),
        )
        inner = trace.set_span_in_context(span)
        waited_from = 0.0
        for index, (run_start, run_end) in enumerate(timeline.runs):
            self._child("wait", inner, at(waited_from), at(run_start), suspended=index > 0)
            self._child("run", inner, at(run_start), at(run_end), segment=index)
            waited_from = run_end
        if not timeline.runs:
            self._child("wait", inner, start, ended, suspended=False)
        if timeline.denoised_s is not None:
            self._child("decode", inner, at(timeline.denoised_s), ended)
        if answered_ns is not None:
            self._child("response", inner, ended, end)
        span.end(end_time=end)

    def _child(self, name: str, context: Any, start: int, end: int, **attributes: Any) -> None:
        span = self._tracer.start_span(
            name, context=context, start_time=start, attributes=attributes
        )
        span.end(end_time=max(start, end))

    def _attributes(
        self,
        request: GenerationRequest,
        request_id: str,
        model: str,
        outcome: str,
        metrics: RequestMetrics,
    ) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "omni_trio.request_id": request_id,
            "omni_trio.model": model,
            "omni_trio.outcome": outcome,
            "omni_trio.width": request.width,
            "omni_trio.height": request.height,
            "omni_trio.images": request.num_images,
            "omni_trio.steps": request.num_steps,
            "omni_trio.steps_done": metrics.steps_done,
            "omni_trio.queue_wait_s": metrics.queue_wait_s,
            "omni_trio.preemptions": metrics.preemptions,
        }
        if request.num_frames is not None:
            attributes["omni_trio.frames"] = request.num_frames
        if request.tenant is not None:
            attributes["omni_trio.tenant"] = request.tenant
        if metrics.cache is not None:
            attributes["omni_trio.cache.calls_skipped"] = metrics.cache.calls_skipped
        prompts = metrics.prompt_cache
        if prompts is not None:
            attributes["omni_trio.prompt_cache.hits"] = prompts.hits
            attributes["omni_trio.prompt_cache.misses"] = prompts.misses
            attributes["omni_trio.prompt_cache.encode_s"] = prompts.encode_s
            attributes["omni_trio.prompt_cache.saved_s"] = prompts.saved_s
        if request.adapter_pairs:
            attributes["omni_trio.adapters"] = [name for name, _ in request.adapter_pairs]
        if self.prompts:
            attributes["omni_trio.prompt"] = request.prompt
        return attributes

    def flush(self) -> None:
        """Send what is queued now (blocks: call it off the event loop)."""
        if self.provider is not None:
            self.provider.force_flush()

    def shutdown(self) -> None:
        """Send what is still queued and stop the exporters (idempotent)."""
        provider, self.provider, self._tracer = self.provider, None, None
        if provider is not None:
            provider.shutdown()
