"""Helpers the serve tests share: the app in-process, the real servers, their bodies.

- in-process: ``make_service`` (a fake model, 64x64, 4 steps), ``serving`` (the
  app's lifespan and an httpx client), ``AsgiCall`` (a hand-driven request that
  disconnects when told);
- the real servers: ``run_server`` (``python -m omni_trio serve`` as a
  subprocess, killed whatever happens; ``run_servers``: several, started at once),
  ``Server``, ``poll_until``, ``free_port``;
- reading answers: ``png_size``, ``parse_sse``, ``parse_sse_lines``, ``metric``;
- bodies: ``BAD_BODIES`` (each a 400 naming its field), ``HOSTILE_BODIES``
  (numbers, encodings and nesting that must still be a 400), ``nested``;
- uploads: ``PixelWork`` (counts what Pillow decodes and resizes, in any thread).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from PIL import Image, ImageFile
from prometheus_client.parser import text_string_to_metric_families

import omni_trio as ot
from omni_trio.serve import ServeConfig, Service
from omni_trio.serve.jobs import JobRow, SqliteJobStore
from omni_trio.testing import FakeRunner
from tests.support.cli import ROOT, free_port

__all__ = [
    "BAD_BODIES",
    "HOSTILE_BODIES",
    "PATH",
    "ROOT",
    "SERVERS",
    "AsgiCall",
    "PixelWork",
    "Server",
    "assert_refused_and_serving",
    "free_port",
    "make_service",
    "metric",
    "nested",
    "parse_sse",
    "parse_sse_lines",
    "png_size",
    "poll_until",
    "run_server",
    "run_servers",
    "serving",
]

#: The checkout's root: the real servers run there, ``examples/`` is there.
SERVERS = ["hypercorn", "uvicorn"]
PATH = "/v1/images/generations"


def make_service(
    runner: FakeRunner | None = None, *, max_body_bytes: int = 4096, **engine: Any
) -> tuple[Service, FakeRunner]:
    """A service on ``runner`` (an instant FakeRunner by default), 64x64 and 4 steps by default."""
    runner = runner if runner is not None else FakeRunner()
    limits: dict[str, Any] = {"max_steps": 1000, "max_height": 256, "max_width": 256}
    limits["max_num_images"] = 4
    config = ServeConfig(
        model_name="fake",
        default_width=64,
        default_height=64,
        default_steps=4,
        max_body_bytes=max_body_bytes,
    )
    service = Service(runner, engine_config=ot.EngineConfig(**{**limits, **engine}), config=config)
    return service, runner


@asynccontextmanager
async def serving(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan; yield a client that calls it in-process."""
    transport = httpx.ASGITransport(app=service.app)
    async with (
        service.app.router.lifespan_context(service.app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        yield client


async def stored_rows(folder: Path) -> list[JobRow]:
    """The rows of the job store in ``folder``, by ``seq`` (opened and closed again, so that
    the next server on the folder gets its lock)."""
    store = SqliteJobStore(folder)
    try:
        return await anyio.to_thread.run_sync(store.open)
    finally:
        store.close()


def png_size(b64_json: str) -> tuple[int, int]:
    """The (width, height) of a base64 PNG."""
    data = base64.b64decode(b64_json)
    assert data.startswith(b"\x89PNG")
    with Image.open(io.BytesIO(data)) as image:
        return image.size


async def assert_refused_and_serving(
    client: httpx.AsyncClient,
    service: Service,
    runner: FakeRunner,
    response: httpx.Response,
    param: str | None,
    code: str,
) -> None:
    """L52: ``response`` is a 400 naming ``param`` with ``code``; nothing was admitted,
    and the service still serves a valid request."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert param is None or param in error["message"]
    assert runner.prepares == 0
    assert service.engine is not None and service.engine.statistics().admitted == 0
    assert (await client.post(PATH, json={"prompt": "x"})).status_code == 200


def parse_sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Split a server-sent event stream into ``(event, data)`` pairs."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


class AsgiCall:
    """One hand-driven ``POST /v1/images/generations``: body first, disconnect when told."""

    def __init__(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": PATH,
            "raw_path": PATH.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-length", str(len(data)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
        }
        self._body: bytes | None = data
        self.disconnect = anyio.Event()
        self.disconnect_delivered = False
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.disconnect.wait()
        # The app acts on the message before its next checkpoint: once this flag is
        # seen by another task, the app has requested the abort.
        self.disconnect_delivered = True
        return {"type": "http.disconnect"}

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(dict(message))

    async def run(self, service: Service) -> None:
        await service.app(self.scope, self.receive, self.send)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return int(starts[0]["status"]) if starts else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


# -- the real servers ------------------------------------------------------------


def poll_until(predicate: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@dataclass
class Server:
    """A running server subprocess."""

    process: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def sample(self, name: str, **labels: str) -> float:
        return metric(self.metrics(), name, **labels)

    def outcome(self, outcome: str) -> float:
        return self.sample("omni_trio_requests_total", outcome=outcome)

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.TransportError:
            return 0

    def post(self, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{PATH}", json=body, timeout=30, **kwargs)

    def wait_idle(self) -> None:
        def idle() -> bool:
            text = self.metrics()
            waiting = metric(text, "omni_trio_requests_waiting")
            return metric(text, "omni_trio_requests_running") == 0 and waiting == 0

        poll_until(idle, timeout=10, what="the server to be idle")


@contextlib.contextmanager
def run_server(*args: str, server: str, log_dir: Path, startup_s: float = 60) -> Iterator[Server]:
    """Start ``python -m omni_trio serve`` with ``args``; yield once /health is 200; kill it."""
    with run_servers(args, server=server, log_dir=log_dir, startup_s=startup_s) as (handle,):
        yield handle


@contextlib.contextmanager
def run_servers(
    *argvs: Sequence[str], server: str, log_dir: Path, startup_s: float = 60
) -> Iterator[list[Server]]:
    """Start one ``python -m omni_trio serve`` per list of arguments, all at once; yield
    them once every /health is 200 (within ``startup_s`` in all); kill them all."""
    handles: list[Server] = []
    try:
        for args in argvs:
            port = free_port()
            command = [sys.executable, "-m", "omni_trio", "serve", "--server", server]
            command += ["--port", str(port), "--no-access-log", *args]
            log = log_dir / f"{server}-{port}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
            handles.append(Server(process, f"http://127.0.0.1:{port}", port, log))
        deadline = time.monotonic() + startup_s
        for handle in handles:
            while handle.health() != 200:
                if handle.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the server did not start:\n{handle.log_text()}")
                time.sleep(0.05)
        yield handles
    finally:
        for handle in handles:
            if handle.process.poll() is None:
                handle.process.kill()
        for handle in handles:
            handle.process.wait(timeout=30)


def parse_sse_lines(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(event, data)`` from server-sent event lines as they arrive."""
    event = ""
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))


# -- bodies ----------------------------------------------------------------------

BAD_BODIES: list[tuple[str, bytes | dict[str, Any], str | None, str]] = [
    ("malformed JSON", b'{"prompt": ', None, "invalid_json"),
    ("not UTF-8", b'{"prompt": "\xff"}', None, "invalid_json"),
    ("not an object", b"[1, 2]", None, "invalid_json"),
    ("unknown field", {"prompt": "x", "colour": "red"}, "colour", "unknown_parameter"),
    ("no prompt", {"n": 1}, "prompt", "missing_required_parameter"),
    ("prompt not a string", {"prompt": 5}, "prompt", "invalid_type"),
    ("n a string", {"prompt": "x", "n": "2"}, "n", "invalid_type"),
    ("n a bool", {"prompt": "x", "n": True}, "n", "invalid_type"),
    ("n zero", {"prompt": "x", "n": 0}, "n", "invalid_value"),
    ("n over the limit", {"prompt": "x", "n": 5}, "n", "invalid_value"),
    ("size a number", {"prompt": "x", "size": 64}, "size", "invalid_type"),
    ("size malformed", {"prompt": "x", "size": "64 by 64"}, "size", "invalid_value"),
    ("size over the limit", {"prompt": "x", "size": "512x64"}, "size", "invalid_value"),
    ("size not a multiple of 8", {"prompt": "x", "size": "60x64"}, "size", "invalid_value"),
    (
        "steps a float",
        {"prompt": "x", "num_inference_steps": 2.5},
        "num_inference_steps",
        "invalid_type",
    ),
    (
        "steps zero",
        {"prompt": "x", "num_inference_steps": 0},
        "num_inference_steps",
        "invalid_value",
    ),
    (
        "steps over the limit",
        {"prompt": "x", "num_inference_steps": 1001},
        "num_inference_steps",
        "invalid_value",
    ),
    (
        "guidance a string",
        {"prompt": "x", "guidance_scale": "high"},
        "guidance_scale",
        "invalid_type",
    ),
    ("guidance NaN", b'{"prompt": "x", "guidance_scale": NaN}', "guidance_scale", "invalid_value"),
    ("seed negative", {"prompt": "x", "seed": -1}, "seed", "invalid_value"),
    ("seed a string", {"prompt": "x", "seed": "1"}, "seed", "invalid_type"),
    ("stream a string", {"prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    (
        "negative prompt a list",
        {"prompt": "x", "negative_prompt": ["a"]},
        "negative_prompt",
        "invalid_type",
    ),
    ("quality a number", {"prompt": "x", "quality": 3}, "quality", "invalid_type"),
    ("user a number", {"prompt": "x", "user": 3}, "user", "invalid_type"),
    (
        "compression over 100",
        {"prompt": "x", "output_compression": 101},
        "output_compression",
        "invalid_value",
    ),
    (
        "partial_images over 3",
        {"prompt": "x", "partial_images": 4},
        "partial_images",
        "invalid_value",
    ),
    (
        "preview_every negative",
        {"prompt": "x", "preview_every": -1},
        "preview_every",
        "invalid_value",
    ),
    (
        "response_format url",
        {"prompt": "x", "response_format": "url"},
        "response_format",
        "unsupported_value",
    ),
    (
        "response_format other",
        {"prompt": "x", "response_format": "raw"},
        "response_format",
        "invalid_value",
    ),
    (
        "output_format gif",
        {"prompt": "x", "output_format": "gif"},
        "output_format",
        "unsupported_value",
    ),
    (
        "background transparent",
        {"prompt": "x", "background": "transparent"},
        "background",
        "unsupported_value",
    ),
    ("another model", {"prompt": "x", "model": "dall-e-3"}, "model", "model_not_found"),
]


def literal(field: str, number: str) -> bytes:
    """A body whose ``field`` is the JSON number literal ``number``, exactly."""
    return b'{"prompt": "x", "' + field.encode() + b'": ' + number.encode() + b"}"


def nested(depth: int, where: str, *, objects: bool = False) -> bytes:
    """``depth`` nested arrays (or objects): the whole body, or the value of field ``where``."""
    value = '{"a": ' * depth + "1" + "}" * depth if objects else "[" * depth + "]" * depth
    return (value if where == "body" else f'{{"prompt": "x", "{where}": {value}}}').encode()


HUGE = str(10**400)
#: Longer than CPython's default limit on int-string conversions (4300 digits).
HUGER = "9" * 5000

#: (name, body, param, code): each must get exactly this 400.
HOSTILE_BODIES: list[tuple[str, bytes, str | None, str]] = [
    *(
        (
            f"{field} {sign}{len(digits)} digits",
            literal(field, sign + digits),
            field,
            "invalid_value",
        )
        for field in (
            "guidance_scale",
            "num_inference_steps",
            "seed",
            "n",
            "output_compression",
            "partial_images",
            "preview_every",
        )
        for digits in (HUGE, HUGER)
        for sign in ("", "-")
    ),
    (
        "guidance over float range",
        literal("guidance_scale", "2" + "0" * 308),
        "guidance_scale",
        "invalid_value",
    ),
    ("guidance 1e400", literal("guidance_scale", "1e400"), "guidance_scale", "invalid_value"),
    (
        "guidance -Infinity",
        literal("guidance_scale", "-Infinity"),
        "guidance_scale",
        "invalid_value",
    ),
    ("n 2**63", literal("n", str(2**63)), "n", "invalid_value"),
    ("seed 2**64", literal("seed", str(2**64)), "seed", "invalid_value"),
    (
        "steps as a huge float",
        literal("num_inference_steps", "1e400"),
        "num_inference_steps",
        "invalid_type",
    ),
    ("UTF-16", json.dumps({"prompt": "x"}).encode("utf-16"), None, "invalid_json"),
    ("UTF-16-LE", json.dumps({"prompt": "x"}).encode("utf-16-le"), None, "invalid_json"),
    ("UTF-16-BE", json.dumps({"prompt": "x"}).encode("utf-16-be"), None, "invalid_json"),
    ("UTF-32", json.dumps({"prompt": "x"}).encode("utf-32"), None, "invalid_json"),
    ("UTF-32-LE", json.dumps({"prompt": "x"}).encode("utf-32-le"), None, "invalid_json"),
    ("Latin-1", '{"prompt": "café"}'.encode("latin-1"), None, "invalid_json"),
    ("UTF-8 byte-order mark", '{"prompt": "x"}'.encode("utf-8-sig"), None, "invalid_json"),
    ("overlong UTF-8", b'{"prompt": "\xc0\xaf"}', None, "invalid_json"),
    ("a surrogate as UTF-8 bytes", b'{"prompt": "\xed\xa0\x80"}', None, "invalid_json"),
    ("nested 100000 deep", nested(100_000, "body"), None, "invalid_json"),
    ("nested 100000 deep in prompt", nested(100_000, "prompt"), None, "invalid_json"),
    ("nested 100000 deep in svg", nested(100_000, "svg"), None, "invalid_json"),
    ("unclosed 100000 deep", b"[" * 100_000, None, "invalid_json"),
    ("nested 50 deep", nested(50, "body"), None, "invalid_json"),
    ("nested 50 deep in prompt", nested(50, "prompt"), "prompt", "invalid_type"),
    ("nested 50 deep, unknown", nested(50, "colour"), "colour", "unknown_parameter"),
    ("lone high surrogate", b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),
    ("lone low surrogate inside", b'{"prompt": "a\\udfffb"}', "prompt", "invalid_value"),
    ("reversed pair", b'{"prompt": "\\ude00\\ud83d"}', "prompt", "invalid_value"),
    (
        "negative prompt surrogate",
        b'{"prompt": "x", "negative_prompt": "\\ud800"}',
        "negative_prompt",
        "invalid_value",
    ),
    ("user surrogate", b'{"prompt": "x", "user": "\\udbff"}', "user", "invalid_value"),
    ("key surrogate", b'{"prompt": "x", "\\ud800": 1}', "\\ud800", "unknown_parameter"),
    (
        "key 100000 long",
        b'{"prompt": "x", "' + b"k" * 100_000 + b'": 1}',
        "k" * 61 + "...",
        "unknown_parameter",
    ),
]


# -- uploads ---------------------------------------------------------------------


class PixelWork:
    """Count what Pillow does with pixels from now on: files decoded, images resized.

    A lazily opened file (``PngImageFile`` ...) reads its header only; its pixels are
    decoded by ``ImageFile.load`` (``convert`` and ``resize`` call it too). Counts in
    any thread (uploads are decoded in a worker thread); ``monkeypatch`` undoes it.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decodes = 0
        self.resizes = 0
        load = ImageFile.ImageFile.load
        resize = Image.Image.resize

        def counted_load(image: ImageFile.ImageFile) -> Any:
            self.decodes += 1
            return load(image)

        def counted_resize(image: Image.Image, *args: Any, **kwargs: Any) -> Image.Image:
            self.resizes += 1
            return resize(image, *args, **kwargs)

        monkeypatch.setattr(ImageFile.ImageFile, "load", counted_load)
        monkeypatch.setattr(Image.Image, "resize", counted_resize)

    @property
    def done(self) -> tuple[int, int]:
        """``(decodes, resizes)`` so far."""
        return self.decodes, self.resizes
