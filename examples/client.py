"""Stream an image from an omni_trio server: a progress bar, then the PNG.

    .venv/bin/python examples/client.py http://127.0.0.1:8000 --prompt "a flower" --out flower.png

Given no URL, it starts ``python -m omni_trio serve --model fake`` on a free
loopback port for the run and stops it afterwards, so it runs anywhere as is.
The server's answer is a stream of server-sent events (see docs/serving.md):
``image_generation.progress`` per step, ``image_generation.partial_image`` when
previews are asked for, then ``image_generation.completed`` with the image, or
``error``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx


def read_events(response: httpx.Response) -> Iterator[tuple[str, dict[str, object]]]:
    """Yield ``(event, data)`` for each server-sent event of ``response``."""
    event, data = "message", ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data += line.removeprefix("data:").strip()
        elif not line and data:
            yield event, json.loads(data)
            event, data = "message", ""


def show_progress(step: int, total: int) -> None:
    """Draw a one-line progress bar on stderr."""
    width = 30
    done = width * min(step, total) // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * done}{'.' * (width - done)}] step {step}/{total}")
    sys.stderr.flush()


def generate(url: str, body: dict[str, object], out: Path) -> int:
    """Stream one generation from ``url`` and save the image to ``out``; return 0 on success."""
    # No overall timeout: a generation may take long. Connecting and each read are bounded.
    timeout = httpx.Timeout(10.0, read=120.0)
    with (
        httpx.Client(base_url=url, timeout=timeout) as client,
        client.stream("POST", "/v1/images/generations", json={**body, "stream": True}) as response,
    ):
        if response.status_code != 200:
            response.read()
            print(f"error {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        previews = 0
        for event, data in read_events(response):
            if event == "image_generation.progress":
                show_progress(int(str(data["step"])), int(str(data["total"])))
            elif event == "image_generation.partial_image":
                previews += 1
            elif event == "image_generation.completed":
                out.write_bytes(base64.b64decode(str(data["b64_json"])))
                sys.stderr.write("\n")
                print(f"saved {out} ({data['size']}, {previews} previews)")
                return 0
            elif event == "error":
                sys.stderr.write("\n")
                print(f"error: {data['error']}", file=sys.stderr)
                return 1
    print("the stream ended without an image", file=sys.stderr)
    return 1


@contextlib.contextmanager
def local_server(
    options: Sequence[str] = ("--model", "fake", "--step-seconds", "0.02"),
) -> Iterator[str]:
    """Run ``omni-trio serve`` with ``options`` on a free loopback port; yield its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "omni_trio", "serve", *options]
    command += ["--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the local server did not start")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    """Parse the command line and run one generation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="server URL; none: start a local fake server")
    parser.add_argument("--prompt", default="a red flower in a blue vase")
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps")
    parser.add_argument("--size", default=None, help="WIDTHxHEIGHT, e.g. 64x64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partial-images", type=int, default=1, help="previews to stream (0-3)")
    parser.add_argument("--out", type=Path, default=Path("client.png"))
    args = parser.parse_args()
    body: dict[str, object] = {
        "prompt": args.prompt,
        "seed": args.seed,
        "partial_images": args.partial_images,
    }
    if args.steps is not None:
        body["num_inference_steps"] = args.steps
    if args.size is not None:
        body["size"] = args.size
    if args.url is not None:
        return generate(args.url, body, args.out)
    with local_server() as url:
        return generate(url, body, args.out)


if __name__ == "__main__":
    sys.exit(main())
