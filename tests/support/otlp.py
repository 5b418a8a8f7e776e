"""An OTLP/HTTP trace receiver on 127.0.0.1 for the tracing tests (L99).

``receiving()`` runs one in a thread of the test process and yields it: its ``endpoint``
is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` names (a replica in another process sends there
too), and ``spans`` holds every span it was sent, with its ids as hex text, in the
order they came.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

__all__ = ["ReceivedSpan", "Receiver", "receiving"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceivedSpan:
    """One span as it came: its name and ids (hex; ``parent`` empty for a root)."""

    name: str
    trace_id: str
    span_id: str
    parent: str


@dataclass(kw_only=True)
class Receiver:
    """A running receiver: where it listens, and what it was sent so far."""

    endpoint: str
    spans: list[ReceivedSpan] = field(default_factory=list)

    def named(self, name: str) -> list[ReceivedSpan]:
        """The spans called ``name``, in the order they came."""
        return [span for span in list(self.spans) if span.name == name]


class _Handler(http.server.BaseHTTPRequestHandler):
    """Keeps every span of each export request in ``received``, answers 200."""

    received: list[ReceivedSpan]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.received.extend(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent=span.parent_span_id.hex(),
                    )
                    for span in scope.spans
                )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def receiving() -> Iterator[Receiver]:
    """Run a receiver on a free port of 127.0.0.1 until the block ends."""
    receiver = Receiver(endpoint="")
    handler = type("Handler", (_Handler,), {"received": receiver.spans})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver")
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
