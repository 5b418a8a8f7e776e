"""Make a video with the OpenAI SDK against an omni_trio server: a job, polled, downloaded.

    .venv/bin/python examples/video_client.py http://127.0.0.1:8000 --prompt "a boat" --seconds 2

Given no URL, it starts ``python -m omni_trio serve --model tiny-wan --jobs-dir none``
on a free loopback port for the run and stops it afterwards, so it runs anywhere as is
(tiny random weights: noise-like frames, real machinery) and leaves nothing behind
(``none``: the jobs live in memory, not in the store in your home that a server keeps
by default). ``client.videos.create`` makes the job and returns at once (``queued``);
``poll`` reads it until it completed or failed; ``download_content`` is the MP4,
written to ``--out``; ``delete`` frees it on the server (finished jobs expire there
anyway, after ``--video-ttl``). The diffusion fields (steps, seed) travel in
``extra_body``. Needs the ``openai`` package; PyAV only on the server.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import openai
from client import local_server  # examples/client.py: the same local server, another model


def make_video(url: str, args: argparse.Namespace) -> int:
    """Create one job on ``url``, wait for it, save its MP4; return 0 on success."""
    # The SDK marks its videos API deprecated (OpenAI's own service is closing it);
    # the calls are what this server implements.
    warnings.filterwarnings("ignore", "The Sora API", DeprecationWarning)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    video = client.videos.create(
        prompt=args.prompt,
        seconds=args.seconds,
        size=args.size,
        extra_body={"num_inference_steps": args.steps, "seed": args.seed},
    )
    print(f"{video.id}: {video.status}, {video.seconds} s at {video.size}")
    video = client.videos.poll(video.id, poll_interval_ms=100)
    if video.status != "completed":
        print(f"{video.id} {video.status}: {video.error}", file=sys.stderr)
        return 1
    data = client.videos.download_content(video.id).read()
    args.out.write_bytes(data)
    extra = video.model_extra or {}
    frames = extra.get("omni_trio", {}).get("num_frames")
    print(f"saved {args.out}: {frames} frames, {len(data)} bytes (what the finished job held)")
    client.videos.delete(video.id)
    return 0


def main() -> int:
    """Parse the command line and make one video."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="server URL; none: start a local tiny-wan server")
    parser.add_argument("--prompt", default="a boat crossing a bay at dawn")
    parser.add_argument("--seconds", default="1", help="clip length (text, as OpenAI's)")
    parser.add_argument("--size", default="32x32", help="WIDTHxHEIGHT (multiples of 16 for Wan)")
    parser.add_argument("--steps", type=int, default=4, help="num_inference_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("video_client.mp4"))
    args = parser.parse_args()
    if args.url is not None:
        return make_video(args.url, args)
    with local_server(["--model", "tiny-wan", "--jobs-dir", "none"]) as url:
        return make_video(url, args)


if __name__ == "__main__":
    sys.exit(main())
